"""Growing a replica's vocabulary when the publisher extends the tokenizer.

Merges are append-only, so every existing id keeps its meaning; only rows are added at
the end of the embedding (V, C) and head (V, C) matrices. Existing rows — weights, θ_round,
AdamW moments, outer momentum — are carried over untouched. New rows take the
deterministic initialisation of a model built at the new size (`init_seed` and the
parameter's name), so every replica that grows to the same vocabulary gets the same rows;
their optimizer moments and outer momentum start at zero.

In a network every replica of a stage must grow at the same round boundary, or the stage's
θ hashes part. The verifier sets that round per stage in its signed member list
(`VocabSchedule`, fed by the tracker): the last stage (the head) first, stage 0 (the embedding)
once the head has grown, so no label ever reaches a head without a row for it. A stage in
between holds neither and never grows; a pipeline without a verifier never grows. A lone node (no
verifier to schedule) grows as soon as it takes the grown manifest. Whoever checks a grown
replica's work reads the vocabulary off what it checks: the length of a θ (`stage_vocab`), the
rows of a checkpoint (`state_vocab`); nothing grows past `vocab_cap`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from neuroshard.protocol.roster import MAX_VOCAB

from .device import Placement
from .diloco import DiLoCo
from .model import ModelConfig, Transformer, stage_layers

VOCAB_PARAMS = ("embedding.weight", "head.weight")
"""Parameters whose first dimension is the vocabulary."""

Params = dict[str, torch.nn.Parameter]
"""A model's parameters by name (`named_parameters`), in parameter order."""


GROWTH_FACTOR = 4
"""A grown vocabulary is at most this many times the definition's (or `GROWTH_ROWS` more, if that is
larger). A run's BPE grows by appended merges, a few thousand at a time; 4x takes a 32k tokenizer
to 128k, as large as any published LLM's. It bounds what a state or segment body may hold: a 125m
stage 0 (dim 768, vocab 32k) may then be 75M values larger than the definition's."""
GROWTH_ROWS = 1 << 16
"""Rows a small definition's vocabulary may grow by whatever its size (a 512-id test run to 64k)."""


def vocab_cap(vocab_size: int) -> int:
    """The largest vocabulary a run defined at `vocab_size` may grow to: the verifier schedules no
    growth past it, its checks accept no stage beyond it, and a middle stage takes no label past it."""
    return min(MAX_VOCAB, max(GROWTH_FACTOR * vocab_size, vocab_size + GROWTH_ROWS))


def holds_vocab(stage: int, num_stages: int) -> bool:
    """Whether stage `stage` of `num_stages` holds vocabulary rows (the embedding or the head)."""
    return stage in (0, num_stages - 1)


def stage_vocab(config: ModelConfig, stage: int, num_stages: int, numel: int) -> int | None:
    """The vocabulary of stage `stage` whose parameters number `numel` (θ's length), from the
    network definition's `config`: `config.vocab_size` plus the rows grown since; None when no
    vocabulary ≥ the definition's gives that length (another model, or a stage without rows
    whose length differs)."""
    layers = stage_layers(config.n_layers, stage, num_stages)
    base = config.num_params(layers=layers, embedding=stage == 0, head=stage == num_stages - 1)
    per_row = config.dim * sum(1 for s in (0, num_stages - 1) if s == stage)  # embedding, head
    extra = numel - base
    if extra == 0:
        return config.vocab_size
    if per_row == 0 or extra < 0 or extra % per_row:
        return None
    return config.vocab_size + extra // per_row


def state_vocab(state: Mapping[str, Tensor], default: int) -> int:
    """The vocabulary of a stage's model state dict: the rows of its embedding or head; `default`
    for a stage that holds neither."""
    for name in VOCAB_PARAMS:
        if name in state:
            return int(state[name].shape[0])
    return default


def _grow_rows(old: Tensor, fill: Tensor) -> Tensor:
    """`fill` (V', ...) with its first V rows replaced by `old` (V, ...)."""
    grown = fill.detach().clone()
    grown[: old.shape[0]] = old
    return grown


def grow_replica(
    model: Transformer, diloco: DiLoCo, vocab_size: int, *, placement: Placement | None = None
) -> tuple[Transformer, DiLoCo]:
    """A new (model, DiLoCo) pair at `vocab_size` carrying all state of the old pair.

    Call it at a round boundary (model weights == θ_round), as the trainer does, with the old pair
    on the CPU. The new DiLoCo uses the default inner optimizer (built for `placement`, default the
    CPU: fused AdamW on CUDA) and the old one's config; its carried optimizer state is on the CPU
    until the caller moves the engine (`DiLoCo.move_to`, as `regrow` does).
    """
    old_vocab = model.config.vocab_size
    if vocab_size < old_vocab:
        raise ValueError(f"a vocabulary only grows: {old_vocab} -> {vocab_size}")
    if vocab_size == old_vocab:
        return model, diloco
    config = dataclasses.replace(model.config, vocab_size=vocab_size)
    grown = Transformer(
        config, layers=model.layer_range, embedding=model.embedding is not None, head=model.head is not None
    )
    old_params = dict(model.named_parameters())
    new_params = dict(grown.named_parameters())
    with torch.no_grad():
        for name, param in new_params.items():
            param.copy_(_grow_rows(old_params[name], param) if name in VOCAB_PARAMS else old_params[name])

    new_diloco = DiLoCo(grown, diloco.config, loss_fn=diloco.loss_fn, placement=placement)
    _carry_inner_state(diloco, new_diloco, old_params, new_params)
    _carry_outer_state(diloco, new_diloco, old_params, new_params)
    new_diloco.step, new_diloco.round, new_diloco.steps_in_round = (
        diloco.step,
        diloco.round,
        diloco.steps_in_round,
    )
    return grown, new_diloco


def _carry_inner_state(old: DiLoCo, new: DiLoCo, old_params: Params, new_params: Params) -> None:
    for name, param in new_params.items():
        state = old.inner_optimizer.state.get(old_params[name])
        if not state:
            continue
        carried = {}
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == old_params[name].shape and name in VOCAB_PARAMS:
                value = _grow_rows(value, torch.zeros_like(param))  # fresh rows: zero moments
            carried[key] = value.clone() if isinstance(value, Tensor) else value
        new.inner_optimizer.state[param] = carried


def _split(flat: Tensor, params: Params) -> dict[str, Tensor]:
    """A flat (d,) vector cut into per-parameter views, in parameter order."""
    parts, offset = {}, 0
    for name, p in params.items():
        parts[name] = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return parts


def _carry_outer_state(old: DiLoCo, new: DiLoCo, old_params: Params, new_params: Params) -> None:
    old_theta = _split(old.theta_round.detach(), old_params)
    new_theta = _split(new.theta_round.detach(), new_params)  # the grown model's weights, new rows included
    with torch.no_grad():
        for name, part in new_theta.items():
            part.copy_(_grow_rows(old_theta[name], part) if name in VOCAB_PARAMS else old_theta[name])
    momentum = old.outer_optimizer.state.get(old.theta_round, {}).get("momentum_buffer")
    if momentum is None:
        return
    old_m = _split(momentum, old_params)
    grown_m = torch.cat(
        [
            (_grow_rows(old_m[name], torch.zeros_like(p)) if name in VOCAB_PARAMS else old_m[name]).flatten()
            for name, p in new_params.items()
        ]
    )
    new.outer_optimizer.state[new.theta_round] = {"momentum_buffer": grown_m}


def model_of(diloco: DiLoCo) -> Transformer:
    """The engine's model, as the Transformer it is (DiLoCo holds any module)."""
    model = diloco.model
    if not isinstance(model, Transformer):
        raise TypeError(f"vocabulary growth needs a Transformer, got {type(model).__name__}")
    return model


def vocab_of(diloco: DiLoCo) -> int:
    """The vocabulary the engine's model trains at."""
    return model_of(diloco).config.vocab_size


def regrow(diloco: DiLoCo, vocab_size: int) -> DiLoCo:
    """`grow_replica` for a replica on any placement: grown on the CPU (where the new rows'
    initialisation is the same on every machine), moved back to its placement, activation
    checkpointing kept. Returns the new engine; its `.model` is the grown model."""
    placement = diloco.placement
    checkpointing = model_of(diloco).activation_checkpointing
    diloco.move_to(Placement.cpu())
    model, grown = grow_replica(model_of(diloco), diloco, vocab_size, placement=placement)
    grown.move_to(placement)  # the carried optimizer state
    model.activation_checkpointing = checkpointing
    return grown


class VocabSchedule:
    """The vocabulary a stage trains at from a round on, as the verifier's signed member list last
    said (protocol.roster.MemberList `vocab_size`, `vocab_from_round`). The tracker's thread sets
    it; the training thread reads it at round boundaries and grows there (`grow_due`), which
    `on_grown` hears: the peer plane republishes the replica's state at its new shape, so a joiner
    or a hash check never reads the old one."""

    def __init__(self, on_grown: Callable[[DiLoCo], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._size = 0
        self._from_round = 0
        self.on_grown = on_grown

    def set(self, vocab_size: int, from_round: int) -> None:
        with self._lock:
            self._size, self._from_round = vocab_size, from_round

    @property
    def planned(self) -> tuple[int, int]:
        """(vocab_size, from_round) as last set; vocab_size 0: no growth scheduled."""
        with self._lock:
            return self._size, self._from_round

    def due(self, round_: int) -> int:
        """The vocabulary a replica starting round `round_` must have; 0 when none is due yet."""
        size, start = self.planned
        return size if size and round_ >= start else 0

    def grow_due(self, diloco: DiLoCo) -> DiLoCo | None:
        """At a round boundary: the engine regrown to the vocabulary due at its round (and
        `on_grown` told), or None when no growth is due."""
        size = self.due(diloco.round)
        if size <= vocab_of(diloco):
            return None
        grown = regrow(diloco, size)
        if self.on_grown is not None:
            self.on_grown(grown)
        return grown
