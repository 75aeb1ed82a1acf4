"""A stopped and restarted replica continues exactly as if it had never stopped."""

import threading
from pathlib import Path

import torch

from neuroshard.node.diloco import DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.trainer import Trainer, TrainerConfig

MODEL = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
DILOCO = DiLoCoConfig(inner_steps=6, inner_lr=3e-3, warmup_steps=3, total_steps=40)


def _trainer(published, checkpoint_dir: Path, max_steps: int, lines: list[str]) -> Trainer:
    return Trainer(
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
