"""The inner loop every replica runs, whichever stage it holds.

A stage-0 replica (`trainer.Trainer`) takes its steps from its own shards; a stage > 0 replica
(`stage_worker.StageWorker`) from the micro-batches that arrive. Everything else is the same
loop, here once: step until `max_steps` or a stop signal, record each step in the round's
segment log, keep the round's losses, print a progress line every `log_every` steps, hand the
engine to the round's finisher when the round is done, take a checkpoint turn between rounds,
and save when the loop ends. A subclass says where a step comes from (`_step`) and what ending
a round, a checkpoint turn and the end of the run mean for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from neuroshard.protocol.segments import Received

from .diloco import DiLoCo
from .segments import SegmentRecorder
from .vocab import VocabSchedule, vocab_of
from .work import RoundWork

RoundFinisher = Callable[[DiLoCo], None]
"""Completes a round on the engine: afterwards `diloco.round` has advanced and the model holds θ_{r+1}."""


def lone_replica(diloco: DiLoCo) -> None:
    """A node alone in its stage applies its own pseudo-gradient."""
    diloco.local_outer_step()


@dataclass
class TrainResult:
    steps: int
    rounds: int
    stopped_by_signal: bool
    losses: list[float] = field(default_factory=list)
    inner_seconds: float = 0.0
    """Time spent in inner steps (forward, backward, optimizer) during this run."""
    wall_seconds: float = 0.0
    """Wall time of this run, rounds and checkpoints included."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where the wall time outside inner steps went, by part: data (next batch), data ahead (on
    CUDA, reading and starting the copy of the batch after it while this step's kernels run, so
    part or all of it overlaps the step: about half did on an H100, bench/RESULTS.md), round (the round
    hook: exchange, aggregation, outer step, hash vote, receipt), checkpoint (periodic snapshots
    on this thread), final checkpoint (the write that ends a run, once per run), log (progress
    lines, the θ hash of the round line; a lone replica on an accelerator hashes θ in the
    background, so only starting that thread is counted, and the next round's hook waits for it,
    in "round"). What the parts leave of the wall time is loop bookkeeping."""

    def breakdown(self) -> str:
        """'inner 51.20 s, round 2.31 s, ...; other 0.10 s': the parts of the wall time."""
        parts = {"inner": self.inner_seconds, **self.seconds}
        other = self.wall_seconds - sum(parts.values())
        return (
            ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items()) + f"; other {other:.2f} s"
        )

    @property
    def utilisation(self) -> float:
        """Share of the run's wall time spent computing inner steps (DiLoCo's point: close to 1)."""
        return self.inner_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0


@dataclass
class Stepped:
    """One inner step as the loop sees it once it is computed."""

    loss: float
    data: tuple[int, int, int] | None = None
    """(shard, first window, end window) a stage-0 step read: its segment record's data claim."""
    micro_batch: str = ""
    """The micro-batch id a stage > 0 step trained on."""
    received: Sequence[Received] = ()
    """The messages the step was computed from, as they arrived (stage > 0)."""
    settle: Callable[[], None] | None = None
    """Run once the step is recorded (a stage > 0 step answers its sender)."""


class InnerLoop:
    """The loop skeleton; `diloco`, `work`, `segments`, `log_every` and `_log` are set by the subclass,
    which implements `_finished`, `_step`, `_finish_round` and `_progress`."""

    diloco: DiLoCo
    work: RoundWork
    """The current round's losses and data (read by the round's finisher, cleared after it)."""
    segments: SegmentRecorder | None
    """Records each inner step for the round's segment log (node.segments); the round hook
    (node.receipt.Receipting) starts, ends and closes its rounds."""
    log_every: int
    _log: Callable[[str], None]
    vocab_schedule: VocabSchedule | None = None
    """Where a verifier schedules the stage's vocabulary growth (node.vocab); None: it never grows here."""
    vocab_rows = "head"
    """The rows a growth extends on this replica's stage (for the log)."""

    def _finished(self) -> bool:
        """Whether `max_steps` is reached."""
        raise NotImplementedError

    def _step(self, result: TrainResult) -> Stepped | None:
        """Compute the next inner step (adding its compute time to `result.inner_seconds`), or
        None when there was none to compute (nothing arrived, or the step failed)."""
        raise NotImplementedError

    def _finish_round(self, seconds: dict[str, float]) -> None:
        """The round is done: hand the engine to the round's finisher and take the round's checkpoint."""
        raise NotImplementedError

    def _progress(self, step: int, window: list[float], seconds: float) -> str:
        """The progress line after `step`; `window` holds the losses since the last one."""
        raise NotImplementedError

    def _grow_as_scheduled(self) -> None:
        """At a round boundary: grow if the verifier scheduled this round (or an earlier one) for the
        stage, and restart the round's segment log from the grown checkpoint."""
        if self.vocab_schedule is None:
            return
        old = vocab_of(self.diloco)
        grown = self.vocab_schedule.grow_due(self.diloco)
        if grown is None:
            return
        self._replace_engine(grown)
        if self.segments is not None:
            self.segments.start_round(grown)
        self._log(
            f"vocabulary grew {old} -> {vocab_of(grown)} at round {grown.round} as scheduled: "
            f"{self.vocab_rows} extended, existing rows kept"
        )

    def _replace_engine(self, engine: DiLoCo) -> None:
        """Train with `engine` from now on (a vocabulary growth built it)."""
        self.diloco = engine

    def _round_done(self) -> bool:
        return self.diloco.round_complete

    def _between_steps(self, step: int, seconds: dict[str, float]) -> None:
        """After a step that did not end a round (a checkpoint turn, for instance)."""

    def _start(self) -> None:
        """Before the first step."""

    def _end(self, result: TrainResult) -> None:
        """After the last step: the checkpoint on stop, whatever else must be let go."""

    def _run_loop(self, stop: threading.Event) -> TrainResult:
        result = TrainResult(steps=self.diloco.step, rounds=self.diloco.round, stopped_by_signal=False)
        window: list[float] = []
        window_start = run_start = time.perf_counter()
        self._start()
        while not self._finished():
            if stop.is_set():
                result.stopped_by_signal = True
                break
            try:
                stepped = self._step(result)
            except Exception as exc:
                if not stop.is_set():
                    raise
                # Cut short by the stop (a pipeline send it abandoned, say): nothing was stepped,
                # so the run ends as stopped, with its checkpoint, not as failed.
                self._log(f"stopping: the step in progress was abandoned ({type(exc).__name__}: {exc})")
                result.stopped_by_signal = True
                break
            if stepped is None:
                continue
            if self.segments is not None:
                self.segments.record_step(
                    self.diloco, data=stepped.data, micro_batch=stepped.micro_batch, received=stepped.received
                )
            if stepped.settle is not None:
                stepped.settle()
            window.append(stepped.loss)
            result.losses.append(stepped.loss)
            step = self.diloco.step
            if self._round_done():
                self._finish_round(result.seconds)
            else:
                self._between_steps(step, result.seconds)
            if step % self.log_every == 0:
                with timed(result.seconds, "log"):
                    self._log(self._progress(step, window, time.perf_counter() - window_start))
                window = []
                window_start = time.perf_counter()
        self._end(result)
        result.steps, result.rounds = self.diloco.step, self.diloco.round
        result.wall_seconds = time.perf_counter() - run_start
        return result


@contextmanager
def timed(seconds: dict[str, float], part: str) -> Iterator[None]:
    """Add the wall time of the block to seconds[part]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[part] = seconds.get(part, 0.0) + time.perf_counter() - start
