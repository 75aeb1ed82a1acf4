"""The training loop of a stage > 0 replica: it trains on the micro-batches that arrive.

Stage 0 drives (`Trainer` reads batches); a later stage has no data of its own. Its peer
server hands each received micro-batch to a `JobQueue`; one worker thread runs the inner
steps in arrival order (one model, one optimizer: never two at once) in the same loop as the
trainer (node.inner_loop), and after H inner steps runs the stage's outer round through the
`finish_round` hook — the same hook the trainer uses, so the stage's replicas agree on θ
exactly as stage 0's do.

Busy policy: while the replica is in its outer round, or when `max_pending` micro-batches
already wait, `offer` refuses and the server answers 503 — the sender retries another
replica of this stage or waits. A refused micro-batch changed nothing here.

No HTTP in this file: jobs come in as tensors, results go out through a callback.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from neuroshard.protocol.identity import sha256_hex

from .checkpoint import CheckpointIdentity, CheckpointMismatch, CheckpointWriter, load_checkpoint
from .diloco import DiLoCo
from .inner_loop import InnerLoop, RoundFinisher, Stepped, TrainResult, lone_replica, timed
from .model import Transformer
from .p2p.pipeline import Busy, Job
from .pipeline import SEND_MARGIN, Blame, Downstream, NonFiniteStep, degenerate_problem, stage_inner_step
from .segments import SegmentRecorder
from .vocab import VocabSchedule, regrow, state_vocab, vocab_of
from .work import RoundWork


@dataclass
class StageCheckpoint:
    """Where a stage > 0 replica keeps its state (written after every round and on stop)."""

    path: Path
    identity: CheckpointIdentity
    writer: CheckpointWriter = field(default_factory=CheckpointWriter)

    older_tokenizers: tuple[str, ...] = ()
    """The current tokenizer's ancestors: a checkpoint made before the tokenizer grew still loads."""

    def load(self, diloco: DiLoCo) -> DiLoCo | None:
        """`diloco` resumed from the checkpoint — regrown first when the checkpoint's vocabulary is
        larger (its stage grew) — or None when there is none; CheckpointMismatch if it is another's."""
        state = load_checkpoint(self.path, self.identity, older_tokenizers=self.older_tokenizers)
        if state is None:
            return None
        vocab = state_vocab(state["model"], vocab_of(diloco))
        if vocab < vocab_of(diloco):  # built at a grown tokenizer's size, which this stage never took
            raise CheckpointMismatch(
                f"{self.path} holds a model of {vocab} ids, this replica is built at {vocab_of(diloco)}: the "
                "tokenizer grew since, and a pipeline grows its vocabulary only on a verifier's schedule (--join)"
            )
        if vocab > vocab_of(diloco):
            diloco = regrow(diloco, vocab)
        diloco.model.load_state_dict(state["model"])
        diloco.load_state_dict(state["diloco"])
        return diloco

    def save(self, diloco: DiLoCo, *, wait: bool) -> None:
        # on the CPU: a checkpoint loads on any machine; its vocabulary is its rows'
        self.writer.submit(self.path, self.identity, diloco.checkpoint_state())
        if wait:
            self.writer.flush()


Forward = Callable[[Tensor, Tensor, str], tuple[Tensor, float]]
"""(hidden (B, T, C), labels (B, T), micro-batch id) -> (∂loss/∂hidden, loss): the stages after this
one, sent the micro-batch under the id it arrived with (a `pipeline.Downstream` bound to one id)."""


@dataclass(kw_only=True)
class WorkerConfig:
    max_steps: int | None = None
    """Stop after this many inner steps in total; None runs until stopped."""
    max_pending: int = 4
    """Micro-batches allowed to wait behind the one being computed; more are refused (503)."""
    log_every: int = 10
    """Inner steps per progress line (mean loss over them)."""

    def __post_init__(self) -> None:
        if self.max_pending < 0 or self.log_every <= 0 or (self.max_steps is not None and self.max_steps < 0):
            raise ValueError(
                f"WorkerConfig needs max_pending >= 0, log_every > 0, max_steps >= 0; got "
                f"{self.max_pending}, {self.log_every}, {self.max_steps}"
            )


@dataclass
class WorkerStats:
    losses: list[float] = field(default_factory=list)
    failed: int = 0
    """Steps that raised (the sender was told and retries elsewhere). Refusals: `JobQueue.refused`."""


class JobQueue:
    """The micro-batches waiting for a stage > 0 replica's worker, with its busy policy: `offer` is
    safe from any thread and refuses (`Busy`, nothing queued, nothing changed) while the worker
    is in its outer round, stopping or done, or when `max_pending` already wait. The pipeline
    route (p2p.pipeline.PipelineService) offers to it; the worker takes from it."""

    def __init__(self, max_pending: int) -> None:
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=max_pending + 1)
        self._lock = threading.Lock()
        self._in_round: int | None = None
        self._closed = ""
        self.refused = 0

    def offer(self, job: Job) -> None:
        """Queue a micro-batch, or raise Busy."""
        with self._lock:
            if self._closed:
                self.refused += 1
                raise Busy(self._closed)
            if self._in_round is not None:
                self.refused += 1
                raise Busy(f"this replica is in its outer round {self._in_round}")
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self.refused += 1
                raise Busy(f"{self._jobs.qsize()} micro-batches already wait here") from None

    def take(self, timeout_s: float) -> Job | None:
        try:
            return self._jobs.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def enter_round(self, round_: int | None) -> None:
        """Refuse new micro-batches while the worker is in round `round_`'s outer step (None:
        take them again), answering those already waiting: their senders retry elsewhere."""
        with self._lock:
            self._in_round = round_
        if round_ is not None:
            self.drain(f"this replica entered its outer round {round_}")

    def close(self, reason: str) -> None:
        """Refuse everything from now on, and answer what waits."""
        with self._lock:
            self._closed = reason
        self.drain(reason)

    def drop(self, sender: str, reason: str) -> int:
        """Answer `Busy(reason)` to the waiting micro-batches of `sender` (its wallet), leaving the
        others queued in order; returns how many. For a sender the route struck: its micro-batches
        already waiting would otherwise each be stepped on, and each may fail the same way."""
        kept: list[Job] = []
        dropped: list[Job] = []
        with self._jobs.mutex:  # queue.Queue's own lock over its deque
            for job in self._jobs.queue:
                ours = job.received is not None and job.received.sender == sender
                (dropped if ours else kept).append(job)
            if dropped:
                self._jobs.queue.clear()
                self._jobs.queue.extend(kept)
                self._jobs.not_full.notify_all()
        for job in dropped:
            job.done(Busy(reason))
        return len(dropped)

    def drain(self, reason: str) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job.done(Busy(reason))


MAX_REPLIES_IN_FLIGHT = 4
"""Gradients waiting to be encoded before the training thread waits for the oldest: bounds the
memory the waiting gradients hold and how late a sender is answered."""


class StageWorker(InnerLoop):
    """One stage > 0 replica's inner steps, on its own thread, on the micro-batches of `jobs`."""

    def __init__(
        self,
        diloco: DiLoCo,
        config: WorkerConfig,
        *,
        log: Callable[[str], None],
        jobs: JobQueue | None = None,
        downstream: Forward | None = None,
        blame: Callable[[str, str], bool] | None = None,
        finish_round: RoundFinisher = lone_replica,
        checkpoint: StageCheckpoint | None = None,
        segments: SegmentRecorder | None = None,
        work: RoundWork | None = None,
        upstream_over: Callable[[], str | None] | None = None,
        vocab_schedule: VocabSchedule | None = None,
        poll_s: float = 0.1,
    ) -> None:
        """`jobs`: where the micro-batches arrive (default: a queue of `config.max_pending`);
        `downstream`: the next stages (None on the last); `blame(micro_batch, why)`: bans the
        next-stage replica whose gradient for that id overflowed the backward, so the step sends
        it elsewhere (node.pipeline.stage_inner_step); `finish_round`: the round's finisher;
        `segments` records every inner step's received and sent messages (node.segments);
        `upstream_over` says why no more work will come (the stage before ended), else None:
        the worker then ends as at `max_steps`. `vocab_schedule` (the last stage's, which holds the
        head): the round from which the replica trains at a grown vocabulary (node.vocab)."""
        self.diloco = diloco
        self.segments = segments
        self.config = config
        self.log_every = config.log_every
        self.jobs = jobs or JobQueue(config.max_pending)
        self.downstream = downstream
        self.blame = blame
        self._log = log
        self._finish_round_hook = finish_round
        self.checkpoint = checkpoint
        self.poll_s = poll_s
        self.stats = WorkerStats()
        self.work = work or RoundWork()
        """This round's losses and tokens, for the round's receipt (node.receipt); cleared after each round."""
        self.upstream_over = upstream_over
        self.vocab_schedule = vocab_schedule
        self.ended_because: str | None = None
        """Why the worker ended before `max_steps` without a stop (the stage before it ended)."""
        self._replies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stage-replies")
        """Encodes the gradients sent back, in step order, off the training thread (`_settle`)."""
        self._in_flight: deque[Future[None]] = deque()
        self._ran = False

    @property
    def finished(self) -> bool:
        return self.config.max_steps is not None and self.diloco.step >= self.config.max_steps

    def run(self, stop: threading.Event, poll_s: float | None = None) -> TrainResult:
        """Train on arriving micro-batches until `max_steps`, `stop`, or `upstream_over` gives a reason
        (kept in `ended_because`); drains refused work on exit. A worker runs once: its reply thread
        and job queue are closed when it ends, so a second run could take a job it cannot answer."""
        if self._ran:
            raise RuntimeError("this StageWorker has already run; build a new one to train again")
        self._ran = True
        if poll_s is not None:
            self.poll_s = poll_s
        return self._run_loop(stop)

    def _finished(self) -> bool:
        if self.finished:
            return True
        if self.upstream_over is not None and self.ended_because is None:
            self.ended_because = self.upstream_over()
        return self.ended_because is not None

    def _step(self, result: TrainResult) -> Stepped | None:
        job = self.jobs.take(self.poll_s)
        if job is None:
            return None
        round_ = self.diloco.round
        step_start = time.perf_counter()
        try:
            grad, loss = stage_inner_step(
                self.diloco, job.hidden, job.labels, self._onward(job), self._blame(job)
            )
        except Exception as exc:  # the sender retries elsewhere; this replica did not step
            self.stats.failed += 1
            try:
                if self.segments is not None:  # what it offered downstream is a failed step's, replayed
                    self.segments.note_failed(
                        job.micro_batch, () if job.received is None else (job.received,)
                    )
            finally:  # the sender is answered even when the segment store cannot write
                job.done(exc)
            return None
        result.inner_seconds += time.perf_counter() - step_start
        self.work.trained(job.labels.numel(), loss)
        self.stats.losses.append(loss)
        received = () if job.received is None else (job.received,)
        return Stepped(
            loss=loss,
            micro_batch=job.micro_batch,
            received=received,
            settle=lambda: self._settle(job, grad, loss, round_),
        )

    def _settle(self, job: Job, grad: Tensor, loss: float, round_: int) -> None:
        """Answer a recorded step. With the job's `encode`, the gradient is encoded on the reply
        thread, noted as the step's gradient sent back and as a header signed naming the step's
        round (node.segments: on disk first), and only then handed to the sender: every reply a
        replica signs is in its log, on the step that computed it (named by
        the recorder's `last_step`, as one replica may train one id twice), and a segment check
        holds the bytes to what the replayed step computed. At most MAX_REPLIES_IN_FLIGHT wait, and
        the round's last step waits for all of them: its log closes complete."""
        if job.encode is None:
            job.done((grad, loss, round_))
            return
        encode = job.encode
        step = None if self.segments is None else self.segments.last_step()

        def reply() -> None:
            try:
                body = encode(grad)
            except Exception as exc:  # nothing was sent (stage_inner_step refuses what no codec takes)
                job.done(exc)
                return
            if self.segments is not None:
                payload = sha256_hex(body)
                if job.received is not None:  # the reply is signed for the activations' sender
                    try:
                        self.segments.note_header(
                            round_, "gradient", job.micro_batch, job.received.sender, payload
                        )
                    except OSError as exc:  # not on disk, so not sent (and not recorded as sent)
                        self._log(f"segments: cannot keep a gradient reply's header, not sending it: {exc}")
                        job.done(exc)
                        return
                self.segments.note_sent(job.micro_batch, "gradient", payload, body, step=step)
            job.done((body, loss, round_))

        self._in_flight.append(self._replies.submit(reply))
        while len(self._in_flight) > (0 if self.diloco.round_complete else MAX_REPLIES_IN_FLIGHT):
            self._in_flight.popleft().result()

    def _progress(self, step: int, window: list[float], seconds: float) -> str:
        return f"step={step} round={self.diloco.round} loss={sum(window) / len(window):.4f} lr={self.diloco.current_lr:.2e}"

    def _end(self, result: TrainResult) -> None:
        self._replies.shutdown(wait=True)  # the replies to steps taken are sent
        self._in_flight.clear()
        self.jobs.close("this replica is stopping")
        if self.checkpoint is not None:
            with timed(result.seconds, "final checkpoint"):
                self.checkpoint.save(self.diloco, wait=True)

    def _onward(self, job: Job) -> Downstream | None:
        """The next stage for this job (None on the last stage), reached under the job's id.

        An output with a position under `SEND_MARGIN` times the degenerate bound
        (node.pipeline.degenerate_problem) is not sent: the step fails as a `NonFiniteStep` that
        is the sender's fault (the service strikes it), and nothing was offered, so the segment
        log records nothing. On honest activations an honest stage's output is far above it; a
        sender that sits at the bound on a shallow stage whose layers add little, or fits its
        activations to this replica's weights, gets here. Without the check (or without the
        margin, against the codec's rounding) the next stage would strike this replica instead."""
        forward = self.downstream
        if forward is None:
            return None
        model = self.diloco.model
        assert isinstance(model, Transformer), "a stage worker trains a node.model stage"
        eps = model.config.norm_eps

        def onward(hidden: Tensor, labels: Tensor) -> tuple[Tensor, float]:
            degenerate = degenerate_problem(hidden, eps, margin=SEND_MARGIN)
            if degenerate is not None:
                raise NonFiniteStep(
                    f"this stage's output on the micro-batch is degenerate: {degenerate}; not sent"
                )
            return forward(hidden, labels, job.micro_batch)

        return onward

    def _blame(self, job: Job) -> Blame | None:
        """Bans the replica whose gradient for this job overflowed its backward (None: no blame)."""
        blame = self.blame
        if blame is None or self.downstream is None:
            return None
        return lambda why: blame(job.micro_batch, why)

    def _finish_round(self, seconds: dict[str, float]) -> None:
        self.jobs.enter_round(self.diloco.round)
        try:
            with timed(seconds, "round"):
                self._finish_round_hook(self.diloco)
                self._grow_as_scheduled()
            with timed(seconds, "checkpoint"):
                if self.checkpoint is not None:
                    self.checkpoint.save(self.diloco, wait=False)
            self._log(f"round={self.diloco.round} done; θ hash {self.diloco.weights_hash()[:16]}")
        finally:
            self.work.clear()
            self.jobs.enter_round(None)
