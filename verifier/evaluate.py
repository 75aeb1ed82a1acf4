"""Measured loss: the held-out cross-entropy of the majority model, computed by the verifier.

Pure torch on node.model. The held-out tokens come from a shard no node trains on; they are
cut into consecutive, non-overlapping windows of seq+1 tokens at stride seq (no
permutation: every evaluation of a run reads the same windows, so two measurements differ
only by the weights), grouped into batches of `batch` windows, the last partial batch
dropped.

`measure_loss` takes a whole model or its pipeline stages in order (stage 0's embedding
first, the last stage's head last): verifier.evaluator fetches every stage's majority θ
from the nodes, loads each into its stage and measures the assembled model this way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from neuroshard.node.diloco import flat_parameters, tensor_digest
from neuroshard.node.model import ModelConfig, Transformer, build_stage, cross_entropy_loss

from .stageshape import state_config


@dataclass(frozen=True)
class LossMeasurement:
    loss: float
    """Mean next-token cross-entropy (nats) over every evaluated token."""
    stderr: float | None
    """Standard error of that mean across batches; None with a single batch."""
    tokens: int
    batches: int


def held_out_batches(
    tokens: Tensor, batch: int, seq: int, max_batches: int | None = None
) -> Iterator[tuple[Tensor, Tensor]]:
    """(inputs, labels), each (batch, seq) int64, from a flat token tensor (N,)."""
    if tokens.dim() != 1:
        raise ValueError(f"held-out tokens must be a flat tensor, got shape {tuple(tokens.shape)}")
    if batch < 1 or seq < 1:
        raise ValueError(f"batch ({batch}) and seq ({seq}) must be ≥ 1")
    windows = (tokens.numel() - 1) // seq
    n_batches = windows // batch
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    if n_batches == 0:
        raise ValueError(
            f"{tokens.numel()} held-out tokens make {windows} windows of {seq}+1; one batch needs {batch}"
        )
    offsets = torch.arange(seq + 1)
    for b in range(n_batches):
        starts = torch.arange(b * batch, (b + 1) * batch) * seq  # (B,)
        rows = tokens[starts[:, None] + offsets].long()  # (B, T+1)
        yield rows[:, :-1], rows[:, 1:]


def _as_stages(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return list(model) if isinstance(model, Sequence) else [model]


@torch.no_grad()
def measure_loss(
    model: nn.Module | Sequence[nn.Module],
    held_out_tokens: Tensor,
    batch: int,
    seq: int,
    *,
    max_batches: int | None = None,
) -> LossMeasurement:
    """Held-out loss of a whole model, or of its stages run in order (stage 0 first)."""
    stages = _as_stages(model)
    was_training = [m.training for m in stages]
    for m in stages:
        m.eval()
    losses: list[float] = []
    try:
        for inputs, labels in held_out_batches(held_out_tokens, batch, seq, max_batches):
            x: Tensor = inputs
            for m in stages:
                x = m(x)
            losses.append(float(cross_entropy_loss(x, labels)))
    finally:
        for m, mode in zip(stages, was_training, strict=True):
            m.train(mode)
    n = len(losses)
    mean = sum(losses) / n  # every batch has batch·seq tokens, so this is the per-token mean
    stderr = None
    if n > 1:
        var = sum((v - mean) ** 2 for v in losses) / (n - 1)
        stderr = math.sqrt(var / n)
    return LossMeasurement(loss=mean, stderr=stderr, tokens=n * batch * seq, batches=n)


def evaluate_model(
    model: nn.Module | Sequence[nn.Module], held_out_tokens: Tensor, batch: int, seq: int
) -> float:
    """Mean held-out cross-entropy (nats) of `model` (or its stages in order)."""
    return measure_loss(model, held_out_tokens, batch, seq).loss


def stage_hash(model: nn.Module) -> str:
    """The θ hash replicas vote with: sha256 of the flat float32 parameters (node.diloco)."""
    return tensor_digest(flat_parameters(model.parameters()))


def build_from_state_dicts(
    config: ModelConfig,
    state_dicts: Sequence[Mapping[str, Tensor]],
    expected_hashes: Sequence[str] | None = None,
) -> list[Transformer]:
    """Every stage of the model with the given weights; each checked against its majority hash,
    and each at the vocabulary its weights hold (grown with the tokenizer, or the definition's)."""
    num_stages = len(state_dicts)
    if expected_hashes is not None and len(expected_hashes) != num_stages:
        raise ValueError(f"{len(expected_hashes)} expected hashes for {num_stages} stages")
    stages = []
    for s, state in enumerate(state_dicts):
        stage = build_stage(state_config(config, state), s, num_stages)
        stage.load_state_dict(dict(state))
        if expected_hashes is not None and stage_hash(stage) != expected_hashes[s]:
            raise ValueError(
                f"stage {s}: weights hash {stage_hash(stage)[:16]}… is not the majority hash "
                f"{expected_hashes[s][:16]}…"
            )
        stages.append(stage)
    return stages


def measure_state_dicts(
    config: ModelConfig,
    state_dicts: Sequence[Mapping[str, Tensor]],
    held_out_tokens: Tensor,
    batch: int,
    seq: int,
    *,
    expected_hashes: Sequence[str] | None = None,
    max_batches: int | None = None,
) -> LossMeasurement:
    """Build the model from per-stage weights (hash-checked) and measure its held-out loss."""
    stages = build_from_state_dicts(config, state_dicts, expected_hashes)
    return measure_loss(stages, held_out_tokens, batch, seq, max_batches=max_batches)
