"""The training loop of a stage > 0 replica: it trains on the micro-batches that arrive.

Stage 0 drives (`Trainer` reads batches); a later stage has no data of its own. Its peer
server hands each received micro-batch to `StageWorker.offer`; one worker thread runs the
inner steps in arrival order (one model, one optimizer: never two at once), counts them, and
after H inner steps runs the stage's outer round through the `finish_round` hook — the same
hook the trainer uses, so the stage's replicas agree on θ exactly as stage 0's do.

Busy policy: while the replica is in its outer round, or when `max_pending` micro-batches
already wait, `offer` refuses and the server answers 503 — the sender retries another
replica of this stage or waits. A refused micro-batch changed nothing here.

No HTTP in this file: jobs come in as tensors, results go out through a callback.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from .checkpoint import CheckpointIdentity, CheckpointWriter, load_checkpoint
from .diloco import DiLoCo
from .p2p.pipeline import Busy, Job
from .pipeline import Downstream, stage_inner_step
from .segments import SegmentRecorder
from .trainer import RoundFinisher, TrainResult, lone_replica
from .work import RoundWork


@dataclass
class StageCheckpoint:
    """Where a stage > 0 replica keeps its state (written after every round and on stop)."""

    path: Path
    identity: CheckpointIdentity
    writer: CheckpointWriter = field(default_factory=CheckpointWriter)

    def load(self, diloco: DiLoCo) -> bool:
        """Resume `diloco` from the checkpoint if there is one; CheckpointMismatch if it is another's."""
        state = load_checkpoint(self.path, self.identity)
        if state is None:
            return False
        diloco.model.load_state_dict(state["model"])
        diloco.load_state_dict(state["diloco"])
        return True

    def save(self, diloco: DiLoCo, *, wait: bool) -> None:
        state = {
            "model": {name: t.detach().clone() for name, t in diloco.model.state_dict().items()},
            "diloco": diloco.state_dict(),
        }
        self.writer.submit(self.path, self.identity, state)
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
    refused: int = 0
    failed: int = 0


class StageWorker:
    """One stage > 0 replica's inner steps, on its own thread; `offer` is safe from any thread."""

    def __init__(
        self,
        diloco: DiLoCo,
        config: WorkerConfig,
        *,
        log: Callable[[str], None],
        downstream: Forward | None = None,
        finish_round: RoundFinisher = lone_replica,
        checkpoint: StageCheckpoint | None = None,
        segments: SegmentRecorder | None = None,
    ) -> None:
        """`segments`: records every inner step's received and sent messages (node.segments); the
        round hook (node.receipt.Receipting) starts, ends and closes its rounds."""
        self.diloco = diloco
        self.segments = segments
        self.config = config
        self.downstream = downstream
        self._log = log
        self._finish_round = finish_round
        self.checkpoint = checkpoint
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=config.max_pending + 1)
        self._lock = threading.Lock()
        self._in_round = False
        self._stopping = False
        self.stats = WorkerStats()
        self.work = RoundWork()
        """This round's losses and tokens, for the round's receipt (node.receipt); cleared after each round."""

    def set_round_finisher(self, finish_round: RoundFinisher) -> None:
        self._finish_round = finish_round

    @property
    def finished(self) -> bool:
        return self.config.max_steps is not None and self.diloco.step >= self.config.max_steps

    def offer(self, job: Job) -> None:
        """Queue a micro-batch, or raise Busy (nothing queued, nothing changed)."""
        with self._lock:
            if self._stopping or self.finished:
                self.stats.refused += 1
                raise Busy("this replica is stopping")
            if self._in_round:
                self.stats.refused += 1
                raise Busy(f"this replica is in its outer round {self.diloco.round}")
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self.stats.refused += 1
                raise Busy(f"{self._jobs.qsize()} micro-batches already wait here") from None

    def _drain(self, reason: str) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job.done(Busy(reason))

    def run(self, stop: threading.Event, poll_s: float = 0.1) -> TrainResult:
        """Train on arriving micro-batches until `max_steps` or `stop`; drains refused work on exit."""
        result = TrainResult(steps=self.diloco.step, rounds=self.diloco.round, stopped_by_signal=False)
        start = time.perf_counter()
        window: list[float] = []
        while not self.finished:
            if stop.is_set():
                result.stopped_by_signal = True
                break
            try:
                job = self._jobs.get(timeout=poll_s)
            except queue.Empty:
                continue
            round_ = self.diloco.round
            step_start = time.perf_counter()
            try:
                grad, loss = stage_inner_step(self.diloco, job.hidden, job.labels, self._onward(job))
            except Exception as exc:  # the sender retries elsewhere; this replica did not step
                self.stats.failed += 1
                job.done(exc)
                continue
            result.inner_seconds += time.perf_counter() - step_start
            if self.segments is not None:
                received = () if job.received is None else (job.received,)
                self.segments.record_step(self.diloco, micro_batch=job.micro_batch, received=received)
            job.done((grad, loss, round_))
            self.work.trained(job.labels.numel(), loss)
            window.append(loss)
            self.stats.losses.append(loss)
            result.losses.append(loss)
            if self.diloco.step % self.config.log_every == 0:
                self._log(
                    f"step={self.diloco.step} round={self.diloco.round} loss={sum(window) / len(window):.4f} "
                    f"lr={self.diloco.current_lr:.2e}"
                )
                window = []
            if self.diloco.round_complete:
                self._outer_round()
        with self._lock:
            self._stopping = True
        self._drain("this replica is stopping")
        if self.checkpoint is not None:
            self.checkpoint.save(self.diloco, wait=True)
        result.steps, result.rounds = self.diloco.step, self.diloco.round
        result.wall_seconds = time.perf_counter() - start
        return result

    def _onward(self, job: Job) -> Downstream | None:
        """The next stage for this job (None on the last stage), reached under the job's id."""
        forward = self.downstream
        if forward is None:
            return None
        return lambda hidden, labels: forward(hidden, labels, job.micro_batch)

    def _outer_round(self) -> None:
        with self._lock:
            self._in_round = True
        self._drain(f"this replica entered its outer round {self.diloco.round}")
        try:
            self._finish_round(self.diloco)
            if self.checkpoint is not None:
                self.checkpoint.save(self.diloco, wait=False)
            self._log(f"round={self.diloco.round} done; θ hash {self.diloco.weights_hash()[:16]}")
        finally:
            self.work.clear()
            with self._lock:
                self._in_round = False
