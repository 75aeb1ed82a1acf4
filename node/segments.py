"""Segment commitments: every replica of every stage hash-chains what it did in a round.

A round of H inner steps is cut into segments of k steps (`SegmentConfig.segment_steps`). The
replica records, for every inner step, a `StepRecord`:

- stage 0: the data span it trained on (shard, first window, end window), which the verifier
  recomputes from the wallet's assignment;
- any stage that received something: for each message, its kind (activations from the previous
  stage, the gradient from the next), the sender's wallet, the sha256 of the sender's signed
  header and of the payload bytes (the header signs that payload hash, so the sender cannot deny
  it sent them and the receiver cannot claim other bytes);
- what it sent on (kind and payload sha256), which the counterpart holds signed the other way;
  the bytes themselves go to the store too, so a segment check can hold what the replica sent to
  what its replayed step computes (verifier.segmentcheck.sent_comparisons);

and, for the round as a whole, every pipeline header it signed naming the round (`SignedHeader`:
activations offered to a next-stage replica, whether it took them or not, and gradients answered
with) — the log of the round a header names must list it (verifier.segmentcheck.contradicting).
Each is handed to the sink (on disk: appended and synced) before the header is sent, so a round
redone after a crash lists what the crashed run signed naming it too;

a middle stage's micro-batches that it forwarded and did not step on (`FailedStep`: every attempt
downstream failed, or its backward did; the worker calls `note_failed`), with what each ran on,
what it offered and after which step, the bytes kept like a step's so a segment check replays
the offer; in a round redone after a crash, the crashed run's offers are listed as failed steps
without their input (its weights are gone: listed, not replayed);

and at every segment boundary (steps 0, k, 2k, …, and the round's last) the sha256 of its weights
and inner AdamW state (`checkpoint_sha256`). `SegmentLog.root()` chains all of it in order; the
root goes into the round's receipt and into a `SegmentCommitment` the replica signs, so a spot
check of one segment (verifier.segmentcheck) holds the replica to checkpoints and inputs it fixed
before it knew which segment is drawn, and a failed check is a proof a third party can re-check.

`SegmentRecorder` builds the log while the replica trains: the training loop calls
`record_step` once per inner step; the round hook (node.receipt.Receipting) calls `start_round`
when a round starts, `end_round` before the outer step and `close_round` after it; the transport
calls `note_received` / `note_sent` / `note_header` from its own thread, and a stage worker
`note_failed` when a step fails.
Pure torch and plain Python; the disk store is node.segment_store.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import Tensor

from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.segments import (
    MAX_MESSAGES_PER_STEP,
    CheckpointOpening,
    FailedStep,
    Received,
    SegmentCommitment,
    SegmentLog,
    SentRef,
    SignedHeader,
    StepRecord,
    max_failed,
    max_failed_in_segment,
    max_headers,
)

from .diloco import DiLoCo, flat_parameters, tensor_digest
from .replay import InnerState, capture_inner_state, reset_inner_state
from .wallet import Wallet

T = TypeVar("T")


@dataclass(kw_only=True)
class SegmentConfig:
    segment_steps: int = 12
    """k, inner steps per segment (a run's is its network definition's `segment_k`: H/40 for a
    network.toml that names none, 12 at the production H = 500). A spot check replays one segment,
    so it costs k/H of the round it checks plus an overhead (bench/bench_replay.py): four checks
    a round measured 0.08 of the checked replica's round at H/40, 0.40–0.44 at H/10. Each segment
    boundary costs the replica a checkpoint (see `max_bytes`)."""
    keep_rounds: int = 3
    """Rounds of checkpoints and received payloads kept on disk to answer challenges (the verifier
    fetches right after sampling, as it does for whole-round replays: node.replay keeps 3 too)."""
    max_bytes: int = 4 << 30
    """Disk budget of the store: whole oldest rounds are dropped until the kept ones fit. Per round
    (`round_bytes`): ⌈H/k⌉ + 1 checkpoints of 12 bytes per parameter (weights, two AdamW moments in
    float32) plus the payloads received and sent (activations and gradients, each way, in the run's
    codec: about half a byte per value with the default fitted43, 2 with bf16). A node sets it from
    its run's definition and the free disk (node.reporting.segment_store); 4 GiB is for code that
    builds a store itself. The round being written is never dropped, so one round larger than the
    budget is still kept alone (and said so)."""

    def __post_init__(self) -> None:
        if self.segment_steps < 1 or self.keep_rounds < 1 or self.max_bytes < 1:
            raise ValueError(
                f"SegmentConfig needs segment_steps, keep_rounds and max_bytes >= 1; got "
                f"{self.segment_steps}, {self.keep_rounds}, {self.max_bytes}"
            )


CHECKPOINT_BYTES_PER_PARAM = 12
"""A segment checkpoint on disk: float32 weights and AdamW's two float32 moments."""


def round_bytes(params: int, inner_steps: int, segment_steps: int, payload_bytes_per_step: int = 0) -> int:
    """Disk one round of segment material takes: a checkpoint at each segment boundary and the
    round's end (⌈H/k⌉ + 1 of them), and the payloads each step received and sent."""
    checkpoints = -(-inner_steps // segment_steps) + 1
    return checkpoints * CHECKPOINT_BYTES_PER_PARAM * params + inner_steps * payload_bytes_per_step


# --- checkpoints ------------------------------------------------------------------------------


def checkpoint_opening(weights: Tensor, inner: InnerState) -> CheckpointOpening:
    """The hashes of a replica's local state: its weights (d,) and inner AdamW state."""
    return CheckpointOpening(weights_sha256=tensor_digest(weights), inner_sha256=inner.digest())


def checkpoint_sha256(weights: Tensor, inner: InnerState) -> str:
    """The commitment to a replica's local state (protocol.segments.checkpoint_hash)."""
    return checkpoint_opening(weights, inner).sha256()


@dataclass(frozen=True)
class SegmentCheckpoint:
    """A replica's local state at a segment boundary: weights (d,) float32 on the CPU and the inner
    AdamW state (node.replay.InnerState)."""

    weights: Tensor
    inner: InnerState

    def sha256(self) -> str:
        return checkpoint_sha256(self.weights, self.inner)


def capture_checkpoint(diloco: DiLoCo) -> SegmentCheckpoint | None:
    """The engine's state now (copies on the CPU); None for an optimizer replay cannot reproduce."""
    inner = capture_inner_state(diloco)
    return None if inner is None else SegmentCheckpoint(flat_parameters(diloco.params), inner)


# --- what one step did ------------------------------------------------------------------------


# --- recording --------------------------------------------------------------------------------


@dataclass
class _Round:
    round: int
    start_step: int
    steps: list[StepRecord] = field(default_factory=list)
    received: list[list[Received]] = field(default_factory=list)
    """Per step, the messages with their bytes (for the store)."""
    checkpoints: list[Future[CheckpointOpening]] = field(default_factory=list)
    """Each checkpoint's hashes, computed (and the checkpoint stored) off the training thread."""
    max_headers: int = 0
    """What a log of the round's H steps may hold (`max_headers`): bursts early in a round are fine."""
    max_failed: int = 0
    headers: set[SignedHeader] = field(default_factory=set)
    failed: list[FailedStep] = field(default_factory=list)
    overflowed: bool = False
    """More signed headers or failed steps than a log may hold: the round gets no log."""
    ended: bool = False


class SegmentSink:
    """Where a recorder puts checkpoints, received payloads and closed logs (node.segment_store
    writes them to disk); this base keeps nothing, for replicas that answer no challenges."""

    def checkpoint(self, round_: int, step: int, checkpoint: SegmentCheckpoint) -> None:
        """The checkpoint at inner step `step` of `round_`."""

    def fit(self, params: int) -> None:
        """Rounds from now on checkpoint `params` parameters (a store sizes its budget by it)."""

    def header(self, round_: int, header: SignedHeader) -> None:
        """A pipeline header about to be sent, naming `round_`: durable when this returns."""

    def headers(self, round_: int) -> list[SignedHeader]:
        """The headers an earlier run handed `header` for `round_` (a round redone after a crash)."""
        return []

    def failed(self, round_: int, index: int, messages: Sequence[Received], body: bytes) -> None:
        """Failed step `index` of the round (`SegmentLog.failed`): what it was given and the
        activations it offered (a segment check replays it)."""

    def received(self, round_: int, step: int, messages: Sequence[Received]) -> None:
        """The messages inner step `step` consumed."""

    def sent(self, round_: int, step: int, kind: str, body: bytes) -> None:
        """A payload inner step `step` sent on (activations forward, a gradient back): kept so a
        segment check can hold it to what the replayed step computes."""

    def close(
        self,
        log: SegmentLog,
        commitment: SegmentCommitment | None,
        end: CheckpointOpening | None = None,
        start: CheckpointOpening | None = None,
    ) -> None:
        """The round's log is complete; `commitment` is its signed root (None when unsigned), `end`
        and `start` the openings of its last and first checkpoints."""

    def abandon(self, round_: int) -> None:
        """Drop what was kept of a round that will not be committed (resumed mid-round)."""

    def committed(self, round_: int) -> bool:
        """Whether a commitment of `round_` is already kept (a node resumed at its start)."""
        return False


MAX_IO_IN_FLIGHT = 2
"""Sink calls (checkpoint hashes and writes, received payloads) queued on the recorder's writer
thread before `record_step` waits for the oldest: memory stays bounded (a checkpoint is 12 bytes
per parameter) and a disk slower than the training falls back to its pace."""


class SegmentRecorder:
    """Builds each round's SegmentLog as the replica trains. `record_step`, `start_round`,
    `end_round` and `close_round` run on the training thread; `note_*` on any thread.

    The training thread only copies a checkpoint (weights and AdamW moments, to the CPU); its
    sha256 and the sink's writes run on one writer thread, in order, so a GPU's inner steps do
    not wait on hashing and writing 12 bytes per parameter every k steps. `close_round` waits for
    them and raises a write's error there."""

    def __init__(
        self,
        config: SegmentConfig,
        *,
        stage: int,
        sink: SegmentSink | None = None,
        log: Callable[[str], None] | None = None,
        network: str | None = None,
    ) -> None:
        self.config = config
        self.stage = stage
        self.network = network
        """The run's definition digest its commitments carry (SegmentCommitment.network)."""
        self.sink = sink or SegmentSink()
        self._log = log
        self._closed: tuple[int, DiLoCo] | None = None
        """(round, engine) of the last round closed with a log: the one a next round continues."""
        self._lock = threading.Lock()
        self._current: _Round | None = None
        self._engine: DiLoCo | None = None
        """The engine the current round started on: a replica that swaps it mid-round (vocabulary
        growth builds a new one) cannot replay from the round's first checkpoint."""
        self._pending_received: list[tuple[str, Received]] = []
        """(micro-batch, message) the step in progress consumed; one of another micro-batch is a
        late answer to an attempt the step gave up on, not this step's."""
        self._pending_sent: list[tuple[str, SentRef, bytes | None]] = []
        self._pending_offered: dict[tuple[str, str], bytes | None] = {}
        """(micro-batch, payload sha256) → bytes of the activations the step in progress offered
        (`note_header`): what a step that fails after offering them records (`note_failed`)."""
        self._late_sent: list[tuple[int, int, str, bytes]] = []
        """(round, step, kind, body) of payloads sent after their step was recorded, for the sink."""
        self._last_step: tuple[int, int] | None = None
        self._warned: set[int] = set()
        """Rounds `note_header` looked up as committed (each is warned about once)."""
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segment-writer")
        self._in_flight: deque[Future[Any]] = deque()

    def _io(self, call: Callable[..., T], *args: Any) -> Future[T]:
        """Run `call(*args)` on the writer thread after everything queued before it."""
        future = self._writer.submit(call, *args)
        self._in_flight.append(future)
        while self._in_flight and (self._in_flight[0].done() or len(self._in_flight) > MAX_IO_IN_FLIGHT):
            self._in_flight.popleft().result()  # raises a failed write's error on this thread
        return future

    def flush(self) -> None:
        """Wait for every queued sink call (and raise the first error)."""
        while self._in_flight:
            self._in_flight.popleft().result()

    def start_round(self, diloco: DiLoCo) -> None:
        """Checkpoint a round about to start (its step 0). A replica resumed mid-round records
        nothing until the next round starts: its earlier steps are not known."""
        self._write_late_sent()
        with self._lock:
            self._pending_received.clear()
            self._pending_sent.clear()
            self._pending_offered.clear()
        if self._current is not None and not self._current.ended:
            self._io(self.sink.abandon, self._current.round)
        self._current = None
        if diloco.steps_in_round != 0:
            return
        self.flush()
        if self.sink.committed(diloco.round):  # a crash after its commitment: the round is not redone here
            if self._log:
                self._log(
                    f"segments: round {diloco.round} was committed before a restart; not recorded again"
                )
            return
        self._io(self.sink.abandon, diloco.round)  # what an interrupted earlier run of this round left
        if self._closed != (diloco.round - 1, diloco) and reset_inner_state(diloco) and self._log:
            self._log(
                f"segments: round {diloco.round} does not follow a round committed here; "
                "its inner optimizer starts fresh"
            )
        checkpoint = capture_checkpoint(diloco)
        if checkpoint is None:
            return
        self.sink.fit(checkpoint.weights.numel())  # a grown vocabulary makes rounds larger
        current = _Round(
            round=diloco.round,
            start_step=diloco.schedule_step,
            max_headers=max_headers(diloco.config.inner_steps),
            max_failed=max_failed(diloco.config.inner_steps),
        )
        with self._lock:  # a header noted meanwhile is on disk already, or is noted after this
            carried: set[tuple[str, str]] = set()
            for header in self.sink.headers(diloco.round):  # what a crashed run signed naming it
                self._add_header(current, header)
                offer = (header.micro_batch, header.payload_sha256)
                if header.kind == "activations" and self.stage > 0 and offer not in carried:
                    carried.add(offer)
                    # Offered by that run, whose steps and weights are gone: listed as failed steps
                    # without their input (not replayed), so its offers match this log.
                    self._add_failed(current, FailedStep(
                        after=0, micro_batch=header.micro_batch, received=(),
                        sent=SentRef(kind="activations", payload_sha256=header.payload_sha256),
                    ))  # fmt: skip
            self._current = current
        self._engine = diloco
        self._checkpoint(checkpoint)

    def note_received(self, message: Received, micro_batch: str = "") -> None:
        """A message the step in progress consumes (the gradient a driver gets back, say), for
        `micro_batch` ("" when unknown: kept whatever the step's id)."""
        with self._lock:
            self._pending_received.append((micro_batch, message))

    def note_discarded(self, micro_batch: str, sender: str) -> None:
        """A message `note_received` took for the step in progress that the step did not consume
        (a gradient refused for overflowing the backward, node.pipeline.NonFiniteStep): left out
        of the step's record, so the step lists what it trained on."""
        with self._lock:
            self._pending_received = [
                (mb, m) for mb, m in self._pending_received if not (mb == micro_batch and m.sender == sender)
            ]

    def last_step(self) -> tuple[int, int] | None:
        """(round, index) of the step `record_step` recorded last, on the training thread: where a
        reply encoded later belongs (`note_sent`'s `step`); None when it recorded none."""
        return self._last_step

    def note_sent(
        self,
        micro_batch: str,
        kind: str,
        payload_sha256: str,
        body: bytes | None = None,
        *,
        step: tuple[int, int] | None = None,
    ) -> None:
        """A payload sent for `micro_batch`. Activations are sent during their step: they go to the
        step in progress. A gradient reply follows its step: it goes to `step` ((round, index), from
        `last_step` when the step was recorded) while that round is open, or without one to the
        newest recorded step of that id among the last 8 (one replica may train one id twice: two
        senders forwarding a driver's micro-batch, so the worker names the step). `body`, its
        bytes (whose sha256 is `payload_sha256`), goes to the sink with the step: a segment check
        replays the step and holds what it sent to what it computed, so a replica that records what
        it sent but sends something else than its step computed is caught (None: not kept, and a
        check of that segment fails)."""
        ref = SentRef(kind=kind, payload_sha256=payload_sha256)
        with self._lock:
            current = self._current
            # Until the round is closed: the reply to its last step is often encoded after end_round.
            if kind != "activations" and current is not None and step is not None:
                if step[0] == current.round and 0 <= step[1] < len(current.steps):
                    self._attach(current, step[1], ref, body)
                return
            if kind != "activations" and current is not None and micro_batch:
                for index in range(len(current.steps) - 1, max(-1, len(current.steps) - 9), -1):
                    step_record = current.steps[index]
                    if step_record.micro_batch == micro_batch:
                        self._attach(current, index, ref, body)
                        return
            if kind == "activations":  # sent during its step; a gradient reply only ever follows one
                self._pending_sent.append((micro_batch, ref, body))

    def note_header(
        self,
        round_: int,
        kind: str,
        micro_batch: str,
        to: str,
        payload_sha256: str,
        body: bytes | None = None,
    ) -> None:
        """A pipeline header this replica is about to sign and send, naming `round_`, for replica
        `to`: call it before sending, for every attempt (activations) and every answer (a gradient).
        The sink keeps it first (durable on disk), whether or not the round is being recorded: a
        round redone after a crash then lists it. Listed in the log of `round_` when that is the
        round being recorded (a header is signed during or just after its step, so it is); a round
        whose headers outgrow what a log may hold (`max_headers`) gets no log rather than one that
        leaves headers out. `body`: the activations' bytes, kept until the step in progress is
        recorded, for `note_failed`."""
        header = SignedHeader(kind=kind, micro_batch=micro_batch, to=to, payload_sha256=payload_sha256)
        self.sink.header(round_, header)
        with self._lock:
            current = self._current
            if current is not None and current.round == round_:  # open until close_round
                self._add_header(current, header)
                if kind == "activations":
                    self._pending_offered.setdefault((micro_batch, payload_sha256), body)
                return
            warn = round_ not in self._warned and self.sink.committed(round_)
            self._warned.add(round_)
        if warn and self._log:
            self._log(
                f"segments: signing pipeline headers naming round {round_}, which this replica committed "
                "before it restarted (its checkpoint is older than that commitment, and no peer was "
                "ahead to take the stage's state from): that round's log cannot list them, so a check "
                "of a replica that received them can prove a contradiction against this one"
            )

    @staticmethod
    def _add_header(current: _Round, header: SignedHeader) -> None:
        """Under the lock (or before `current` is shared)."""
        if current.overflowed or header in current.headers:
            return
        if len(current.headers) >= current.max_headers:
            current.overflowed = True
            current.headers.clear()
            return
        current.headers.add(header)

    def _add_failed(self, current: _Round, failed: FailedStep) -> None:
        """Under the lock (or before `current` is shared). A round with more failed steps than a
        log holds, in all or in one segment (`max_failed_in_segment`), gets no log."""
        if current.overflowed:
            return
        k = self.config.segment_steps
        crowd = sum(1 for f in current.failed if f.received and f.after // k == failed.after // k)
        if len(current.failed) >= current.max_failed or (
            failed.received and crowd >= max_failed_in_segment(k)
        ):
            current.overflowed = True
            current.failed.clear()
            return
        current.failed.append(failed)

    def _attach(self, current: _Round, index: int, ref: SentRef, body: bytes | None) -> None:
        """Under the lock: a payload sent after step `index` was recorded. A retried request is
        answered again with the same bytes: recorded once. A step sends one payload of a kind (the
        store keeps one), the first."""
        step = current.steps[index]
        if all(r.kind != ref.kind for r in step.sent) and len(step.sent) < MAX_MESSAGES_PER_STEP:
            step.sent.append(ref)
            if body is not None:  # written by the training thread (`_write_late_sent`)
                self._late_sent.append((current.round, index, ref.kind, body))

    def note_failed(self, micro_batch: str, received: Sequence[Received] = ()) -> None:
        """The step in progress failed (its micro-batch is retried, here or elsewhere): what it
        gathered is not the next step's. If it offered activations downstream (the headers it
        signed for them are listed), it is recorded as a `FailedStep` with `received`, the messages
        it ran on, and the sink keeps them with the offered bytes: a segment check replays the
        offer at the weights it was computed with, as it replays a step."""
        with self._lock:
            offered = [(p, b) for (mb, p), b in self._pending_offered.items() if mb == micro_batch]
            self._pending_received.clear()
            self._pending_sent.clear()
            self._pending_offered.clear()
            current = self._current
            if not offered or current is None or current.ended or not received:
                return
            payload, body = offered[0]  # a job encodes its output once: every attempt carries it
            failed = FailedStep(
                after=len(current.steps),
                micro_batch=micro_batch,
                received=tuple(m.ref() for m in received[:1]),
                sent=SentRef(kind="activations", payload_sha256=payload),
            )
            self._add_failed(current, failed)
            index = len(current.failed) - 1
        if not current.overflowed and body is not None:
            self._io(self.sink.failed, current.round, index, list(received[:1]), body)

    def record_step(
        self,
        diloco: DiLoCo,
        *,
        data: tuple[int, int, int] | None = None,
        micro_batch: str = "",
        received: Sequence[Received] = (),
    ) -> None:
        """After one inner step: its record, with what `note_*` gathered during it; a checkpoint
        every `segment_steps` steps. A driver's step takes the micro-batch id its transport sent."""
        self._last_step = None
        current = self._current
        with self._lock:
            micro_batch = micro_batch or next((mb for mb, _, _ in self._pending_sent if mb), "")
            messages = [*received, *(m for mb, m in self._pending_received if not mb or mb == micro_batch)]
            messages = messages[:MAX_MESSAGES_PER_STEP]
            pending = [(ref, body) for mb, ref, body in self._pending_sent if mb == micro_batch]
            bodies = {ref: body for ref, body in pending if body is not None}
            sent = list(dict.fromkeys(ref for ref, _ in pending))[:1]  # a step forwards one payload
            self._pending_received.clear()
            self._pending_sent.clear()
            self._pending_offered.clear()
        self._write_late_sent()
        if current is None or current.ended:
            return
        if diloco is not self._engine:  # the model was rebuilt since the round's first checkpoint
            self._io(self.sink.abandon, current.round)
            self._current = None
            return
        record = StepRecord(
            data=data, micro_batch=micro_batch, received=[m.ref() for m in messages], sent=sent
        )
        with self._lock:
            current.steps.append(record)
        index = len(current.steps) - 1
        self._last_step = (current.round, index)
        if messages:
            self._io(self.sink.received, current.round, index, messages)
        for ref in sent:
            if ref in bodies:
                self._io(self.sink.sent, current.round, index, ref.kind, bodies[ref])
        if len(current.steps) % self.config.segment_steps == 0:
            self._checkpoint_now(diloco)

    def end_round(self, diloco: DiLoCo) -> None:
        """The round's inner steps are over (call before the outer step): its last checkpoint."""
        current = self._current
        if current is None or current.ended:
            return
        if diloco.round != current.round or len(current.steps) != diloco.steps_in_round:
            self._io(self.sink.abandon, current.round)  # steps happened that were not recorded here
            self._current = None
            return
        if len(current.steps) % self.config.segment_steps != 0 or not current.steps:
            self._checkpoint_now(diloco)
        current.ended = True

    def close_round(self, sign: Wallet | None = None) -> tuple[SegmentLog, SegmentCommitment | None] | None:
        """The ended round's log (after the outer step, so late `note_sent`s are in) and, with a
        wallet `sign`, its signed commitment; None when this round was not recorded whole."""
        current = self._current
        self._write_late_sent()
        if current is None or not current.ended:
            self.flush()  # an abandoned round is gone from the sink when this returns
            return None
        self._current = None
        with self._lock:
            steps = tuple(current.steps)
            headers = tuple(sorted(current.headers))
            failed = tuple(current.failed)
        if (
            current.overflowed
            or len(headers) > max_headers(len(steps))
            or len(failed) > max_failed(len(steps))
            or any(f.after >= len(steps) for f in failed)
        ):
            if self._log:
                self._log(
                    f"segments: round {current.round} signed more pipeline headers or failed more "
                    f"steps than a log holds ({max_headers(len(steps))}, {max_failed(len(steps))}); no log for it"
                )
            self._io(self.sink.abandon, current.round)
            self.flush()
            return None
        openings = [f.result() for f in current.checkpoints]
        try:
            log = SegmentLog(
                stage=self.stage,
                round=current.round,
                segment_steps=self.config.segment_steps,
                start_step=current.start_step,
                steps=steps,
                checkpoints=tuple(o.sha256() for o in openings),
                headers=headers,
                failed=failed,
            )
        except Refused as exc:  # what was recorded is no log a verifier reads: none, not a broken one
            if self._log:
                self._log(f"segments: round {current.round} recorded no valid log ({exc}); no log for it")
            self._io(self.sink.abandon, current.round)
            self.flush()
            return None
        commitment = (
            None
            if sign is None
            else SegmentCommitment.create(
                sign, stage=self.stage, round=current.round, root=log.root(), network=self.network
            )
        )
        self._io(self.sink.close, log, commitment, openings[-1], openings[0])
        self.flush()  # the round is on disk before its receipt names the root
        if self._engine is not None:
            self._closed = (current.round, self._engine)
        return log, commitment

    def _write_late_sent(self) -> None:
        """On the training thread: hand the sink the payloads sent after their step was recorded."""
        with self._lock:
            late, self._late_sent = self._late_sent, []
        for round_, step, kind, body in late:
            self._io(self.sink.sent, round_, step, kind, body)

    def _checkpoint_now(self, diloco: DiLoCo) -> None:
        checkpoint = capture_checkpoint(diloco)
        assert checkpoint is not None  # the optimizer was AdamW-shaped at the round's start
        self._checkpoint(checkpoint)

    def _checkpoint(self, checkpoint: SegmentCheckpoint) -> None:
        current = self._current
        assert current is not None
        current.checkpoints.append(self._io(self._store, current.round, len(current.steps), checkpoint))

    def _store(self, round_: int, step: int, checkpoint: SegmentCheckpoint) -> CheckpointOpening:
        """On the writer thread: keep the checkpoint and return its hashes."""
        self.sink.checkpoint(round_, step, checkpoint)
        return checkpoint_opening(checkpoint.weights, checkpoint.inner)
