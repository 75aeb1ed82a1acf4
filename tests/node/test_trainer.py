"""A stopped and restarted replica continues exactly as if it had never stopped."""

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest
import torch
from tests_support import small_corpus

from neuroshard.data import assign_shards, open_dataset
from neuroshard.data.publish import TOKENIZER_NAME, publish_shards
from neuroshard.node.checkpoint import CheckpointMismatch
from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.p2p.pipeline import PipelineUnavailable
from neuroshard.node.pipeline import MAX_BLAMED, NonFiniteStep, remote_loss
from neuroshard.node.rotation import RotationConfig
from neuroshard.node.trainer import Trainer, TrainerConfig
from neuroshard.node.vocab import VocabSchedule
from neuroshard.tokenizer import BPETokenizer

MODEL = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
DILOCO = DiLoCoConfig(inner_steps=6, inner_lr=3e-3, warmup_steps=3, total_steps=40)


def _trainer(published, checkpoint_dir: Path, max_steps: int, lines: list[str], **kw) -> Trainer:  # type: ignore[no-untyped-def]
    return Trainer(
        **kw,
        wallet_id="feedface",
        dataset=published.dataset,
        model_config=MODEL,
        diloco_config=DILOCO,
        config=TrainerConfig(batch_size=2, seq_len=32, max_steps=max_steps, checkpoint_every=4, log_every=1),
        checkpoint_dir=checkpoint_dir,
        log=lines.append,
    )


def test_resume_continues_bit_identically(published, tmp_path: Path) -> None:
    straight = _trainer(published, tmp_path / "a", 20, [])
    full = straight.run(threading.Event())

    first = _trainer(published, tmp_path / "b", 11, [])
    first.run(threading.Event())
    lines: list[str] = []
    second = _trainer(published, tmp_path / "b", 20, lines)
    assert any("resumed from" in line and "step=11 round=1" in line for line in lines)
    rest = second.run(threading.Event())

    assert rest.losses == full.losses[11:]
    assert (rest.steps, rest.rounds) == (full.steps, full.rounds) == (20, 3)
    for (name, a), b in zip(
        straight.model.state_dict().items(), second.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert second.batches.position == straight.batches.position


def test_stop_event_ends_the_loop_and_saves(published, tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    trainer = _trainer(published, tmp_path, 100, [])
    result = trainer.run(stop)
    assert result.stopped_by_signal and result.steps == 0
    assert trainer.checkpoint_file.exists()


def _extended_copy(published, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A copy of the data set whose publisher then extended the tokenizer by 24 merges and appended shards."""
    directory = tmp_path / "ds"
    shutil.copytree(published.directory, directory)
    old = BPETokenizer.load(directory / TOKENIZER_NAME)
    old.extend(small_corpus(50_000), 24).save(directory / TOKENIZER_NAME)
    publish_shards(small_corpus(80_000), out=directory, key=published.key, shard_tokens=5_000)
    return open_dataset(directory, bytes(published.key.verify_key))


def _trainer_on(dataset, checkpoint_dir: Path, max_steps: int, lines: list[str], **kw) -> Trainer:  # type: ignore[no-untyped-def]
    return Trainer(
        wallet_id="feedface",
        dataset=dataset,
        model_config=dataclasses.replace(MODEL, vocab_size=dataset.tokenizer.vocab_size),
        diloco_config=DILOCO,
        config=TrainerConfig(batch_size=2, seq_len=32, max_steps=max_steps, checkpoint_every=4, log_every=1),
        checkpoint_dir=checkpoint_dir,
        log=lines.append,
        **kw,
    )


def test_restart_after_the_tokenizer_grew_resumes_and_grows_the_vocabulary(published, tmp_path: Path) -> None:
    first = _trainer_on(published.dataset, tmp_path / "ck", 6, [])
    first.run(threading.Event())
    before = first.model.embedding.weight.detach().clone()  # type: ignore[union-attr]
    extended = _extended_copy(published, tmp_path)
    lines: list[str] = []
    second = _trainer_on(extended, tmp_path / "ck", 12, lines)
    assert any("resumed from" in line and "step=6 round=1" in line for line in lines)
    assert "vocabulary grew 512 -> 536 at round 1: embedding and head extended, existing rows kept" in lines
    assert torch.equal(second.model.embedding.weight[:512], before)  # type: ignore[union-attr]
    result = second.run(threading.Event())
    assert (result.steps, result.rounds) == (12, 2)


def test_newer_manifest_is_taken_at_a_round_boundary(published, tmp_path: Path) -> None:
    extended = _extended_copy(published, tmp_path)
    updates = iter([None, extended])
    lines: list[str] = []
    trainer = _trainer_on(
        published.dataset, tmp_path / "ck", 14, lines, dataset_updates=lambda: next(updates, None)
    )
    shard = trainer.batches.shard_id
    trainer.run(threading.Event())
    assert trainer.model.config.vocab_size == 536 and trainer.dataset is extended
    assert any("data set updated to manifest version 2" in line for line in lines)
    assert trainer.batches.shard_id == shard  # stayed on its shard; the order now covers the new ones too


def test_checkpoint_from_a_foreign_tokenizer_is_refused(published, tmp_path: Path) -> None:
    _trainer_on(published.dataset, tmp_path / "ck", 2, []).run(threading.Event())
    directory = tmp_path / "other"
    directory.mkdir()
    BPETokenizer.train(small_corpus(60_000)[5:], 512).save(directory / TOKENIZER_NAME)
    publish_shards(small_corpus(80_000), out=directory, key=published.key, shard_tokens=5_000)
    foreign = open_dataset(directory, bytes(published.key.verify_key))
    with pytest.raises(CheckpointMismatch, match="tokenizer_sha256"):
        _trainer_on(foreign, tmp_path / "ck", 4, [])


def test_resume_is_exact_when_the_plateau_test_rotates(published, tmp_path: Path) -> None:
    """The plateau detector's window is checkpointed, so a resumed run rotates where a straight one does."""
    rotation = RotationConfig(min_steps=4, window=2, z=10.0)

    def trainer(directory: Path, max_steps: int, lines: list[str] | None = None) -> Trainer:
        return Trainer(
            wallet_id="feedface",
            dataset=published.dataset,
            model_config=MODEL,
            diloco_config=DILOCO,
            config=TrainerConfig(
                batch_size=2,
                seq_len=32,
                max_steps=max_steps,
                checkpoint_every=4,
                log_every=1,
                rotation=rotation,
            ),
            checkpoint_dir=directory,
            log=[].append if lines is None else lines.append,
        )

    lines: list[str] = []
    straight = trainer(tmp_path / "a", 30, lines)
    full = straight.run(threading.Event())
    trainer(tmp_path / "b", 13).run(threading.Event())
    resumed = trainer(tmp_path / "b", 30)
    rest = resumed.run(threading.Event())
    assert rest.losses == full.losses[13:]
    assert resumed.batches.position == straight.batches.position
    assert sum("rotating to the next shard" in line for line in lines) >= 3


def test_restart_after_a_new_publish_resumes_on_the_same_shard(published, tmp_path: Path) -> None:
    first = _trainer_on(published.dataset, tmp_path / "ck", 10, [])
    first.run(threading.Event())
    shard, offset = first.batches.shard_id, first.batches.position.offset
    extended = _extended_copy(published, tmp_path)  # more shards: the node's order changes
    assert assign_shards("feedface", extended.manifest) != assign_shards(
        "feedface", published.dataset.manifest
    )
    second = _trainer_on(extended, tmp_path / "ck", 12, [])
    assert (second.batches.shard_id, second.batches.position.offset) == (shard, offset)


def test_the_time_breakdown_charges_a_slow_round_hook_to_round(published, tmp_path: Path) -> None:
    def slow_round(diloco) -> None:  # type: ignore[no-untyped-def]
        threading.Event().wait(0.2)
        diloco.outer_step(diloco.pseudo_gradient())

    trainer = _trainer(published, tmp_path, 12, [], finish_round=slow_round)
    result = trainer.run(threading.Event())
    assert result.rounds == 2
    assert 0.4 <= result.seconds["round"] < result.wall_seconds - result.inner_seconds
    assert set(result.seconds) == {"data", "data ahead", "round", "checkpoint", "final checkpoint", "log"}
    other = float(result.breakdown().rsplit("other ", 1)[1].removesuffix(" s"))
    assert 0 <= other < 0.1 * result.wall_seconds


def test_a_scheduled_replica_holds_a_grown_manifest_until_its_round(published, tmp_path: Path) -> None:
    """In a network the verifier names the round (VocabSchedule): the grown manifest seen at round 1
    waits, and the replica grows and takes it at round 2 — the round every replica of its stage grows."""
    extended = _extended_copy(published, tmp_path)
    updates = iter([extended])
    schedule = VocabSchedule()
    grown_at: list[int] = []
    schedule.on_grown = lambda diloco: grown_at.append(diloco.round)
    lines: list[str] = []
    trainer = _trainer_on(
        published.dataset,
        tmp_path / "ck",
        18,
        lines,
        dataset_updates=lambda: next(updates, None),
        vocab_schedule=schedule,
    )
    schedule.set(536, 2)  # the tracker reads the verifier's list once the replica runs
    trainer.run(threading.Event())
    assert grown_at == [2]
    assert trainer.model.config.vocab_size == 536 and trainer.dataset is extended
    held = next(i for i, line in enumerate(lines) if "taken at the round the verifier schedules" in line)
    grew = lines.index(
        "vocabulary grew 512 -> 536 at round 2 as scheduled: embedding and head extended, existing rows kept"
    )
    taken = next(i for i, line in enumerate(lines) if "data set updated to manifest version 2" in line)
    assert held < grew < taken


def test_a_pipeline_stage_without_a_schedule_stays_on_the_old_manifest(published, tmp_path: Path) -> None:
    extended = _extended_copy(published, tmp_path)
    lines: list[str] = []
    trainer = _trainer_on(
        published.dataset,
        tmp_path / "ck",
        12,
        lines,
        dataset_updates=lambda: extended,
        num_stages=2,
        loss_fn=lambda out, labels: out.float().pow(2).mean(),
    )
    trainer.run(threading.Event())
    assert trainer.model.config.vocab_size == 512 and trainer.dataset is published.dataset
    assert sum("this run has none: staying on the old manifest" in line for line in lines) == 1


def test_a_replica_started_after_its_stage_s_growth_was_scheduled_starts_grown(
    published, tmp_path: Path
) -> None:
    """Joined (its model the definition's 512 ids): new or resumed, it takes the scheduled size
    (its stage trains at it by now, or will in a few rounds); on a grown data set that its stage is
    not scheduled to reach yet, it refuses to start and says why."""
    extended = _extended_copy(published, tmp_path)
    schedule = VocabSchedule()

    def joined(dataset, directory: str, max_steps: int) -> Trainer:  # type: ignore[no-untyped-def]
        return Trainer(
            wallet_id="feedface", dataset=dataset, model_config=MODEL, diloco_config=DILOCO,
            config=TrainerConfig(batch_size=2, seq_len=32, max_steps=max_steps, checkpoint_every=4, log_every=1),
            checkpoint_dir=tmp_path / directory, log=lambda line: None, vocab_schedule=schedule,
        )  # fmt: skip

    schedule.set(536, 1)
    assert joined(extended, "new", 4).model.config.vocab_size == 536
    _trainer(published, tmp_path / "old", 6, []).run(threading.Event())  # a checkpoint at round 1
    resumed = joined(published.dataset, "old", 12)
    assert resumed.diloco.round == 1 and resumed.model.config.vocab_size == 536
    schedule.set(536, 5)  # back from a while away: its checkpoint's round 1 is behind the growth's
    assert joined(extended, "old", 12).model.config.vocab_size == 536
    unscheduled = VocabSchedule()
    with pytest.raises(ValueError, match="stage 0 is not scheduled to grow to them yet"):
        Trainer(
            wallet_id="feedface", dataset=extended, model_config=MODEL, diloco_config=DILOCO,
            config=TrainerConfig(batch_size=2, seq_len=32, max_steps=4), checkpoint_dir=tmp_path / "u",
            log=lambda line: None, vocab_schedule=unscheduled,
        )  # fmt: skip


def test_a_pipeline_driver_steps_past_next_stage_replicas_whose_gradients_overflow_it(
    published, tmp_path: Path
) -> None:
    """Stage 0 of 2 through `Trainer`: more overflowing answers in a row than one stage > 0 step
    takes (MAX_BLAMED, each blamed: the transport bans the replica) still leave the driver stepping
    on the next honest one, with the same activations object sent every time (not recomputed),
    finite weights and every step of the run taken."""
    answers = iter([3e38] * (MAX_BLAMED + 2))
    blamed: list[str] = []
    sent: list[torch.Tensor] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        sent.append(hidden)
        value = next(answers, None)
        return torch.full_like(hidden, 1e-3 if value is None else value), 2.0

    def blame(why: str) -> bool:
        blamed.append(why)
        return True

    trainer = _trainer_on(
        published.dataset, tmp_path / "ck", 6, [], num_stages=2, loss_fn=remote_loss(downstream, blame)
    )
    trainer.run(threading.Event())
    assert trainer.diloco.step == 6 and len(blamed) == MAX_BLAMED + 2
    assert all(s is sent[0] for s in sent[: MAX_BLAMED + 3])  # one step's attempts: the same tensor
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


def test_a_pipeline_driver_whose_blame_bans_no_one_stops_instead_of_spinning(
    published, tmp_path: Path
) -> None:
    calls: list[str] = []

    def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        calls.append("sent")
        return torch.full_like(hidden, 3e38), 2.0

    trainer = _trainer_on(
        published.dataset, tmp_path / "ck", 6, [], num_stages=2,
        loss_fn=remote_loss(downstream, lambda why: False),
    )  # fmt: skip
    with pytest.raises(NonFiniteStep) as refused:
        trainer.run(threading.Event())
    assert refused.value.gradient_at_fault and len(calls) == 1 and trainer.diloco.step == 0
    assert trainer.diloco.loss_fn.resend is None  # type: ignore[attr-defined]


def test_a_step_cut_short_by_the_stop_ends_the_run_as_stopped_with_its_checkpoint(
    published, tmp_path: Path
) -> None:
    """A driver waiting on the pipeline when the node is told to stop (`PipelineClient.forward`
    raises: "the node is stopping"): the run ends as stopped by the signal, not as failed, and
    writes its checkpoint at the last step taken. The same failure without the stop is raised."""
    stop = threading.Event()
    answered = [0]

    def downstream(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        if answered[0] == 3:
            stop.set()  # as a signal handler would, while this send waits
            raise PipelineUnavailable("micro-batch 00000000: the node is stopping")
        answered[0] += 1
        return torch.full_like(hidden, 1e-3), 2.0

    lines: list[str] = []
    trainer = _trainer_on(
        published.dataset, tmp_path / "ck", 6, lines, num_stages=2, loss_fn=remote_loss(downstream)
    )
    result = trainer.run(stop)
    assert result.stopped_by_signal and trainer.diloco.step == 3
    assert any("the step in progress was abandoned (PipelineUnavailable" in line for line in lines)
    resumed: list[str] = []
    _trainer_on(published.dataset, tmp_path / "ck", 6, resumed, num_stages=2, loss_fn=remote_loss(downstream))
    assert any("resumed from" in line and "step=3 " in line for line in resumed), resumed

    answered[0] = -100  # never stops: the same failure is an error
    failing = _trainer_on(
        published.dataset, tmp_path / "ck2", 6, [], num_stages=2,
        loss_fn=remote_loss(lambda h, y: (_ for _ in ()).throw(PipelineUnavailable("nobody took it"))),
    )  # fmt: skip
    with pytest.raises(PipelineUnavailable, match="nobody took it"):
        failing.run(threading.Event())
