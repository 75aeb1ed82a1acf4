"""The work lies as the trainers that tell them: a Δ claimed 1.25 × too large, and windows read in
an order the wallet was not assigned under the spans it was."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from neuroshard.adversary.work_lies import DELTA_FACTOR, ScaledDeltaTrainer, UnassignedDataTrainer
from neuroshard.node.diloco import DiLoCo, DiLoCoConfig
from neuroshard.node.model import ModelConfig
from neuroshard.node.trainer import Trainer, TrainerConfig

MODEL = ModelConfig(vocab_size=512, dim=32, n_layers=2, n_heads=2, ffn_dim=64, max_seq_len=32)
DILOCO = DiLoCoConfig(inner_steps=3, inner_lr=3e-3, warmup_steps=1, total_steps=40)


def _round(cls: type[Trainer], published, directory: Path) -> tuple[torch.Tensor, list, list[float]]:  # type: ignore[no-untyped-def, type-arg]
    """One round of `cls`: the Δ it hands in, the spans it claims and the losses it saw."""
    seen: list[tuple[torch.Tensor, list, list[float]]] = []  # type: ignore[type-arg]

    def finish(diloco: DiLoCo) -> None:
        seen.append((diloco.pseudo_gradient().clone(), list(trainer.work.spans), list(trainer.work.losses)))
        diloco.outer_step(diloco.pseudo_gradient())

    trainer = cls(
        wallet_id="feedface",
        dataset=published.dataset,
        model_config=MODEL,
        diloco_config=DILOCO,
        config=TrainerConfig(batch_size=2, seq_len=32, max_steps=3, checkpoint_every=100, log_every=100),
        checkpoint_dir=directory,
        log=lambda line: None,
        finish_round=finish,
    )
    trainer.run(threading.Event())
    assert len(seen) == 1
    return seen[0]


def test_the_delta_lie_hands_in_a_scaled_delta_from_honest_training(published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    honest, spans, losses = _round(Trainer, published, tmp_path / "honest")
    lied, lied_spans, lied_losses = _round(ScaledDeltaTrainer, published, tmp_path / "liar")
    assert lied_spans == spans and lied_losses == losses  # the same work...
    assert torch.allclose(lied, DELTA_FACTOR * honest, rtol=1e-5, atol=1e-7)  # ...claimed larger
    assert not torch.allclose(lied, honest)


def test_the_data_lie_claims_the_assigned_spans_but_trains_on_other_windows(
    published, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    _, spans, losses = _round(Trainer, published, tmp_path / "honest")
    _, lied_spans, lied_losses = _round(UnassignedDataTrainer, published, tmp_path / "liar")
    assert lied_spans == spans
    assert lied_losses != losses
