"""A stage-0 replica: batches from its shards, DiLoCo inner steps, outer rounds, checkpoints.

The loop itself (node.inner_loop) is the one every replica runs; this module says where a
stage-0 step comes from and what its rounds and checkpoints are. It knows nothing of the
network. A round ends after H inner steps — or, when the caller passes `round_closing` and the
stage's majority has already contributed the round, after at least EARLY_CLOSE_FRACTION of them. It then hands its DiLoCo
engine to `finish_round`, which must leave it at the next round's start: normally by
`outer_step` with the aggregated pseudo-gradient of the stage's replicas, or — for a
replica that fell behind or disagrees with the majority — by adopting a peer's state.
A lone node applies its own pseudo-gradient.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from neuroshard.data import BatchStream, DataPosition, Dataset, assign_shards

from .checkpoint import CheckpointIdentity, CheckpointWriter, checkpoint_path, load_checkpoint
from .device import CopyStream, Placement
from .diloco import DiLoCo, DiLoCoConfig, LossFn, tensor_digest
from .inner_loop import InnerLoop, RoundFinisher, Stepped, TrainResult, lone_replica, timed
from .model import ModelConfig, build_stage, cross_entropy_loss
from .pipeline import DRIVER_MAX_BLAMED, RemoteLoss, driver_inner_step, stage_fingerprint
from .rotation import PlateauDetector, RotationConfig
from .segments import SegmentRecorder
from .vocab import VocabSchedule, model_of, regrow
from .work import RoundWork

RoundClosing = Callable[[int], bool]
"""Whether the stage is already closing round r (PeerPlane.round_closing): stop and contribute."""

EARLY_CLOSE_FRACTION = 0.75
"""A replica asked to close its round early does so only after this share of H inner steps. Its Δ
must still pass validation against the round's median, whose norm-ratio floor is 0.5 (honest
full-length Δs measured ≥ 0.87, validation.ValidationConfig): a Δ of ¾ of the steps keeps well
clear of it (Δ grows with the steps, between √ and linearly), while a replica far behind keeps
training and, if it misses the round, adopts the new state as a late replica does."""


@dataclass(kw_only=True)
class TrainerConfig:
    batch_size: int = 8
    """Sequences per inner step."""
    seq_len: int = 128
    """Tokens per sequence (≤ the model's max_seq_len)."""
    max_steps: int | None = None
    """Stop once the network's inner step (`DiLoCo.schedule_step`: round × H + steps in the round)
    reaches this; None runs until stopped. A function of the round, not of this replica's own
    count: a round closed early counts as its full H and a replica that adopted a later round's
    state (joined, late) is as far as its peers, so the replicas of a stage stop after the same
    round, across restarts too."""
    checkpoint_every: int = 50
    """Inner steps between checkpoint turns; every outer step is a turn too. A turn writes unless
    the previous write is still in flight or `checkpoint_interval_s` has not passed; the
    checkpoint on stop is always written."""
    checkpoint_interval_s: float = 0.0
    """Minimum wall time between two periodic or round-end checkpoints, and from the start to the
    first (0: every turn; the final one is always written; a --fresh run over an older checkpoint
    writes at its first turn). On a GPU, 50 steps of the 125m preset take ~2.5 s while its 1.5 GB
    checkpoint costs ~1.5 s of loop time (bench/RESULTS.md, issue 14), so the node's CLI sets
    300 s on accelerators."""
    log_every: int = 10
    """Inner steps per progress line; the printed loss is the mean over those steps."""
    rotation: RotationConfig = field(default_factory=RotationConfig)
    """When to leave a shard whose loss has plateaued."""
    held_out_shards: tuple[int, ...] = ()
    """Shards this replica never trains on: the verifier's held-out evaluation data."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: activation
    memory drops from every layer's to one layer's, for about one more forward of compute."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "checkpoint_every", "log_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.checkpoint_interval_s < 0:
            raise ValueError(f"checkpoint_interval_s must be ≥ 0, got {self.checkpoint_interval_s}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be ≥ 0, got {self.max_steps}")


def _ahead_of_the_model(tokenizer: int, model: int, schedule: VocabSchedule | None) -> str:
    """Why a replica cannot start on a data set whose tokenizer has more ids than its model."""
    if schedule is not None:
        return (
            f"the run's tokenizer has {tokenizer} ids, and stage 0 is not scheduled to grow to them yet "
            f"(this replica is at {model}). The verifier reads the manifest every minute and, in a pipeline, "
            "grows stage 0's embedding only once the last stage's head has trained a round at the new "
            "size: a few rounds of the last stage after the tokenizer was published (or its member list "
            "could not be read at start: see above). Start this replica again once GET "
            f"/api/stages/0/members names vocab_size {tokenizer}"
        )
    return (
        f"the data set's tokenizer grew to {tokenizer} ids since this replica's checkpoint ({model} ids); "
        "a pipeline grows its vocabulary only on a verifier's schedule (--join), and this run has none"
    )


DatasetUpdates = Callable[[], Dataset | None]
"""Polled at round boundaries: a newer verified data set (manifest version) or None."""


class Trainer(InnerLoop):
    """A stage-0 replica: inner steps on batches of its own shards (`InnerLoop` runs them)."""

    batches: BatchStream
    """This replica's batches: its assigned shards in its wallet's window order."""

    def __init__(
        self,
        *,
        wallet_id: str,
        dataset: Dataset,
        model_config: ModelConfig,
        diloco_config: DiLoCoConfig,
        config: TrainerConfig,
        checkpoint_dir: Path,
        log: Callable[[str], None],
        finish_round: RoundFinisher = lone_replica,
        round_closing: RoundClosing | None = None,
        work: RoundWork | None = None,
        segments: SegmentRecorder | None = None,
        dataset_updates: DatasetUpdates | None = None,
        fresh: bool = False,
        num_stages: int = 1,
        loss_fn: LossFn | None = None,
        placement: Placement | None = None,
        vocab_schedule: VocabSchedule | None = None,
    ) -> None:
        """`num_stages` > 1 makes this replica stage 0 of a pipeline (embedding and the first
        layers); `loss_fn` then sends its output on (`pipeline.remote_loss`). `placement`: where
        the inner loop runs (default: CPU, fp32); checkpoints are written from CPU copies.

        `finish_round` completes each round (the peer network, through the receipting hook when a
        verifier is watched); `round_closing`, when given, ends a round before H inner steps once
        it says the stage's majority already contributed it (after EARLY_CLOSE_FRACTION of H);
        `work` collects the round's data spans and losses for whoever finishes the round, and
        `segments` records each inner step for the round's segment log (node.segments).

        `vocab_schedule`: in a network with a verifier, the round from which the stage's replicas
        train at a grown vocabulary (node.vocab); a grown manifest then waits until that round, so
        every replica grows at the same boundary. Without one, a lone replica grows as soon as it
        takes a grown manifest; a pipeline stage never does (its head lives on another stage)."""
        if config.seq_len > model_config.max_seq_len:
            raise ValueError(
                f"seq_len {config.seq_len} exceeds the model's max_seq_len {model_config.max_seq_len}"
            )
        if model_config.vocab_size != dataset.tokenizer.vocab_size and vocab_schedule is None:
            raise ValueError(
                f"model vocab_size {model_config.vocab_size} != tokenizer vocab_size {dataset.tokenizer.vocab_size}"
            )
        self.config = config
        self._log = log
        self.log_every = config.log_every
        self._finish_round_hook = finish_round
        self._round_closing = round_closing
        self._dataset_updates = dataset_updates
        self.vocab_schedule = vocab_schedule
        self._held: Dataset | None = None
        """A newer data set whose tokenizer is ahead of the model, held until the scheduled growth."""
        self.wallet_id = wallet_id
        self.dataset = dataset
        self.checkpoint_file = checkpoint_path(checkpoint_dir, wallet_id, stage=0)
        self.num_stages = num_stages
        self.placement = placement or Placement.cpu()
        self.lookahead = self.placement.is_cuda
        """Read the next batch while a step computes (BatchFeed); on by default only on CUDA, where
        the copy overlaps the kernels. Tests turn it on for the CPU to check its bookkeeping."""
        checkpoint_dir.mkdir(parents=True, exist_ok=True)  # an unusable directory fails now, not 50 steps in
        self._writer = CheckpointWriter()
        self.checkpoints_skipped = 0
        """Periodic checkpoints skipped because the previous write was still in flight."""
        self.hash_in_background = self.placement.device.type != "cpu"
        """Hash θ for a round's log line on a thread while the next round's steps run (on an
        accelerator the CPU is idle then); on the CPU it would compete with the steps. Tests turn
        it on for the CPU to check that the lines name the right θ."""
        self._round_log: threading.Thread | None = None
        """The last round's log line, hashing θ in the background (`_log_round_done`)."""
        self._round_log_error: BaseException | None = None
        # The checkpoint interval counts from start-up: the file on disk is the state just loaded
        # (or there is none yet). Only a --fresh run over an older file writes at its first turn,
        # so that a restart does not resume the run it replaced.
        self._last_checkpoint = -math.inf if fresh and self.checkpoint_file.exists() else time.monotonic()
        self.work = work or RoundWork()
        """The current round's data spans and losses (read by the round hook, cleared after it)."""
        self.segments = segments
        """Records each inner step's data span for the round's segment log (node.segments); the round
        hook (node.receipt.Receipting) starts, ends and closes its rounds."""
        state = None if fresh else self._load_state(model_config)
        saved_vocab = int(state["vocab_size"]) if state else model_config.vocab_size
        self.model = build_stage(dataclasses.replace(model_config, vocab_size=saved_vocab), 0, num_stages)
        self.model.activation_checkpointing = config.activation_checkpointing
        self.diloco = DiLoCo(
            self.model, diloco_config, loss_fn=loss_fn or cross_entropy_loss, placement=self.placement
        )
        order = assign_shards(wallet_id, dataset.manifest, exclude=config.held_out_shards)
        position = DataPosition()
        self._plateau = PlateauDetector(config.rotation)
        if state is not None:
            self.model.load_state_dict(state["model"])
            self.diloco.load_state_dict(state["diloco"])
            saved = state["data_position"]
            position = DataPosition.of_shard(order, int(saved["shard_id"]), int(saved["offset"]))
            self._plateau.load_state_dict(state["plateau"])
            self._log(
                f"resumed from {self.checkpoint_file} at step={self.diloco.step} round={self.diloco.round} "
                f"(shard {saved['shard_id']}, offset {position.offset})"
            )
        if vocab_schedule is not None:
            # Started after the verifier scheduled the stage's growth (read before this replica was
            # built), new or resumed: the size its stage most likely trains at by now (a replica back
            # from a while away is behind the growth round; join_state takes the grown peers' state).
            # One started between the scheduling and that round is ahead for those rounds.
            self._grow_vocab(max(model_config.vocab_size, vocab_schedule.planned[0]))
        elif num_stages == 1:
            self._grow_vocab(model_config.vocab_size)  # a lone replica: the tokenizer's size, at once
        if dataset.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                _ahead_of_the_model(
                    dataset.tokenizer.vocab_size, self.model.config.vocab_size, vocab_schedule
                )
            )
        self.batches = BatchStream(
            source=dataset.source,
            manifest=dataset.manifest,
            order=order,
            seed=wallet_id,
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            position=position,
            on_skip=lambda shard_id, reason: log(
                f"skipping shard {shard_id}: {reason}; moving to the next shard"
            ),
        )

    def _round_done(self) -> bool:
        d = self.diloco
        if d.round_complete:
            return True
        return (
            self._round_closing is not None
            and d.steps_in_round >= math.ceil(EARLY_CLOSE_FRACTION * d.config.inner_steps)
            and self._round_closing(d.round)
        )

    @property
    def identity(self) -> CheckpointIdentity:
        return CheckpointIdentity(
            wallet_id=self.wallet_id,
            stage=0,
            model_fingerprint=stage_fingerprint(self.model.config, self.num_stages),
            tokenizer_sha256=self.dataset.manifest.tokenizer.sha256,
        )

    def _load_state(self, model_config: ModelConfig) -> dict[str, Any] | None:
        expected = CheckpointIdentity(
            wallet_id=self.wallet_id,
            stage=0,
            model_fingerprint=stage_fingerprint(model_config, self.num_stages),
            tokenizer_sha256=self.dataset.manifest.tokenizer.sha256,
        )
        ancestors = [t.sha256 for t in self.dataset.manifest.tokenizers[:-1]]
        return load_checkpoint(self.checkpoint_file, expected, older_tokenizers=ancestors)

    def _grow_vocab(self, vocab_size: int) -> None:
        if vocab_size <= self.model.config.vocab_size:
            return
        old = self.model.config.vocab_size
        self._replace_engine(regrow(self.diloco, vocab_size))
        self._log(
            f"vocabulary grew {old} -> {vocab_size} at round {self.diloco.round}: {self.vocab_rows} extended, "
            "existing rows kept"
        )

    @property
    def vocab_rows(self) -> str:  # type: ignore[override]
        return "embedding and head" if self.num_stages == 1 else "embedding"

    def _replace_engine(self, engine: DiLoCo) -> None:
        self.diloco, self.model = engine, model_of(engine)

    def _apply_dataset_update(self) -> None:
        """At a round boundary: grow if scheduled, then move to a newer manifest (more shards,
        maybe a grown tokenizer) — one whose tokenizer is ahead of the model waits for its growth."""
        self._grow_as_scheduled()
        update = self._held
        if self._dataset_updates is not None:
            update = self._dataset_updates() or update
        if update is None:
            return
        ahead = update.tokenizer.vocab_size > self.model.config.vocab_size
        if ahead and (self.vocab_schedule is not None or self.num_stages > 1):
            if self._held is None or self._held.manifest.version != update.manifest.version:
                self._log(
                    f"manifest version {update.manifest.version} grows the vocabulary to {update.tokenizer.vocab_size}; "
                    + (
                        "it is taken at the round the verifier schedules for this stage"
                        if self.vocab_schedule is not None
                        else "a pipeline grows only on a verifier's schedule, and this run has none: staying on the old manifest"
                    )
                )
            self._held = update
            return
        self._held = None
        self.dataset = update
        self._grow_vocab(update.tokenizer.vocab_size)
        order = assign_shards(self.wallet_id, update.manifest, exclude=self.config.held_out_shards)
        self.batches.update(update.source, update.manifest, order)
        self._log(
            f"data set updated to manifest version {update.manifest.version} "
            f"({update.manifest.total_shards} shards, vocab {update.tokenizer.vocab_size})"
        )

    def save(self, *, wait: bool = True) -> None:
        """Checkpoint the replica; with wait=False the file is written in the background."""
        if wait:
            self._writer.flush()  # one snapshot in memory at a time (pinned host memory on CUDA)
        state = {
            # The model's tensors are live; a snapshot (on the CPU) lets the background write see
            # this step's values.
            **self.diloco.checkpoint_state(),
            "data_position": self.batches.saved_position(),
            "plateau": self._plateau.state_dict(),
            "vocab_size": self.model.config.vocab_size,
        }
        self._writer.submit(self.checkpoint_file, self.identity, state)
        self._last_checkpoint = time.monotonic()
        if wait:
            self._writer.flush()

    def _save_in_turn(self) -> None:
        """A periodic or round-end checkpoint, written in the background — or skipped while the
        previous write is still in flight, so the loop never waits on the disk: a GPU trains a
        125M model's 50 steps in less time than its 1.5 GB checkpoint takes to write. The next
        turn writes a newer state; the final checkpoint (`save()`) always waits. A turn within
        `checkpoint_interval_s` of the last checkpoint is passed over."""
        if not self._writer.busy:
            self._writer.flush()  # a failed background write is raised now, not at the next write
        if time.monotonic() - self._last_checkpoint < self.config.checkpoint_interval_s:
            return
        if self._writer.busy:
            if self.checkpoints_skipped == 0:
                self._log(
                    f"checkpoint at step={self.diloco.step} skipped: the previous write is still in flight "
                    "(the disk is slower than --checkpoint-every steps; later skips are not logged)"
                )
            self.checkpoints_skipped += 1
            return
        self.save(wait=False)

    def _finish_round(self, seconds: dict[str, float]) -> None:
        self._feed.rewind()  # the round's data spans end with this step; the data set may change
        steps, h = self.diloco.steps_in_round, self.diloco.config.inner_steps
        if steps < h:
            self._log(
                f"round={self.diloco.round} closed early after {steps} of {h} inner steps (the stage's majority pushed)"
            )
        with timed(seconds, "round"):
            self._join_round_log()  # the last round's line may still be hashing θ_round, which this changes
            self._finish_round_hook(self.diloco)
            self.work.clear()
            self._apply_dataset_update()
        with timed(seconds, "checkpoint"):
            if self.num_stages > 1 and self.segments is not None:
                # The round's log is committed: a restart from an older checkpoint would train the
                # round again and sign pipeline headers naming it that its log cannot list
                # (node.segments). So the round's end is always written, right away.
                self._writer.flush()
                self.save(wait=False)
            else:
                self._save_in_turn()
        with timed(seconds, "log"):
            self._log_round_done()

    def _log_round_done(self) -> None:
        """The round's log line with θ's hash. Where the round has not hashed θ already (a lone
        replica; a networked one hashes it to publish and vote) and the steps run on an
        accelerator (`hash_in_background`), θ_round is hashed on a background thread while the
        device starts the next round: the CPU is idle then, and sha256 of a 125M model's θ took
        0.28 s of a 5.4 s round on an H100 (bench/RESULTS.md, issue 14). The thread reads θ_round
        itself, not a copy (a 365 MB copy on the training thread, most likely most of the 40 ms a
        round the "log" part took there): nothing writes θ_round before the next round's hook, and
        `_finish_round` waits for this line before it runs that hook."""
        self._join_round_log()
        line = f"round={self.diloco.round} done; θ hash "
        known = self.diloco.known_weights_hash()
        if known is not None or not self.hash_in_background:
            self._log(line + (known or self.diloco.weights_hash())[:16])
            return
        theta = self.diloco.theta_round.detach()

        def hash_and_log() -> None:
            try:
                self._log(line + tensor_digest(theta)[:16])
            except BaseException as exc:  # raised on the training thread at the next join
                self._round_log_error = exc

        self._round_log = threading.Thread(target=hash_and_log, name="round-log", daemon=True)
        self._round_log.start()

    def _join_round_log(self) -> None:
        """Wait for the last round's background log line (lines stay in round order) and raise
        what it raised."""
        if self._round_log is not None:
            self._round_log.join()
            self._round_log = None
        error, self._round_log_error = self._round_log_error, None
        if error is not None:
            raise error

    def run(self, stop: threading.Event) -> TrainResult:
        """Train until `max_steps` or until `stop` is set; always leaves a checkpoint behind."""
        return self._run_loop(stop)

    def _finished(self) -> bool:
        return self.config.max_steps is not None and self.diloco.schedule_step >= self.config.max_steps

    def _start(self) -> None:
        self._feed = BatchFeed(lambda: self.batches, self.placement, ahead=self.lookahead)
        self._last_shard = self.batches.shard_id

    def _step(self, result: TrainResult) -> Stepped:
        with timed(result.seconds, "data"):
            batch = self._feed.take()
        self.work.read(batch.shard_id, batch.start, batch.end)
        if batch.shard_id != self._last_shard:
            self._plateau.reset()
        self._last_shard = batch.shard_id
        step_start = time.perf_counter()
        if isinstance(self.diloco.loss_fn, RemoteLoss):  # a pipeline's driver: refuses overflowing gradients
            queued = driver_inner_step(self.diloco, batch.inputs, batch.labels, max_blamed=DRIVER_MAX_BLAMED)
        else:
            queued = self.diloco.queue_inner_step(batch.inputs, batch.labels)
        queued_s = time.perf_counter() - step_start
        with timed(result.seconds, "data ahead"):
            self._feed.read_ahead()  # on CUDA: the next batch's copy overlaps this step's kernels
        step_start = time.perf_counter()
        loss = queued.item()
        result.inner_seconds += queued_s + time.perf_counter() - step_start
        if self._plateau.observe(loss):
            self._log(f"loss plateaued on shard {self.batches.shard_id}; rotating to the next shard")
            self._feed.rewind()
            self.batches.rotate()
            self._plateau.reset()
        self.work.losses.append(loss)
        return Stepped(loss=loss, data=(batch.shard_id, batch.start, batch.end))

    def _between_steps(self, step: int, seconds: dict[str, float]) -> None:
        if step % self.config.checkpoint_every == 0:
            self._feed.rewind()  # the saved position is the next batch to train on
            with timed(seconds, "checkpoint"):
                self._save_in_turn()

    def _progress(self, step: int, window: list[float], seconds: float) -> str:
        tokens_per_s = len(window) * self.batches.tokens_per_batch / max(seconds, 1e-9)
        return (
            f"step={step} round={self.diloco.round} loss={sum(window) / len(window):.4f} "
            f"lr={self.diloco.current_lr:.2e} tok/s={tokens_per_s:.0f} shard={self.batches.shard_id}"
        )

    def _end(self, result: TrainResult) -> None:
        self._join_round_log()
        self._feed.rewind()
        with timed(result.seconds, "final checkpoint"):
            self.save()


@dataclass
class FedBatch:
    """A batch on the device with the data span it came from."""

    rows: Tensor
    """(B, T + 1) int64 token ids: `inputs` and `labels` are views of it."""
    shard_id: int
    start: int
    """First window (offset in the shard's window order) of the batch."""
    end: int
    before: DataPosition
    """The stream's position before this batch was read: where `rewind` puts it back."""

    @property
    def inputs(self) -> Tensor:
        """(B, T) input ids."""
        return self.rows[:, :-1]

    @property
    def labels(self) -> Tensor:
        """(B, T) next-token labels: labels[b, t] is the token after inputs[b, t]."""
        return self.rows[:, 1:]


class BatchFeed:
    """The trainer's batches, moved to the device. On CUDA it reads one batch ahead and copies it
    on a side stream while the current step computes; `rewind` hands an unused look-ahead batch
    back to the stream, so data spans, checkpoints and shard rotation see exactly the batches
    trained on. On the CPU there is no look-ahead (nothing to overlap) and `rewind` is a no-op."""

    def __init__(self, stream: Callable[[], BatchStream], placement: Placement, *, ahead: bool) -> None:
        self._stream = stream  # read anew each time: the trainer may swap its stream (work_lies)
        self._copy = CopyStream(placement)
        self._ahead = ahead
        self._pending: FedBatch | None = None

    def _read(self) -> FedBatch:
        stream = self._stream()
        before = stream.position
        # One transfer of the (B, T + 1) rows; inputs and labels are views of it on the device.
        rows = self._copy.start(stream.next_rows())
        end = stream.position.offset
        return FedBatch(rows, stream.shard_id, end - rows.shape[0], end, before)

    def take(self) -> FedBatch:
        batch, self._pending = self._pending or self._read(), None
        self._copy.ready(batch.rows)
        return batch

    def read_ahead(self) -> None:
        if self._ahead and self._pending is None:
            self._pending = self._read()

    def rewind(self) -> None:
        if self._pending is not None:
            self._stream().position = self._pending.before
            self._pending = None
