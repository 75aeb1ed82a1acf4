"""Growing a replica's vocabulary when the publisher extends the tokenizer.

Merges are append-only, so every existing id keeps its meaning; only rows are added at
the end of the embedding (V, C) and head (V, C) matrices. Existing rows — weights, θ_round,
AdamW moments, outer momentum — are carried over untouched. New rows take the
deterministic initialisation of a model built at the new size (`init_seed` and the
parameter's name), so every replica that grows to the same vocabulary gets the same rows;
their optimizer moments and outer momentum start at zero.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .diloco import DiLoCo
from .model import Transformer

VOCAB_PARAMS = ("embedding.weight", "head.weight")
"""Parameters whose first dimension is the vocabulary."""

Params = dict[str, torch.nn.Parameter]
"""A model's parameters by name (`named_parameters`), in parameter order."""


def _grow_rows(old: Tensor, fill: Tensor) -> Tensor:
    """`fill` (V', ...) with its first V rows replaced by `old` (V, ...)."""
    grown = fill.detach().clone()
    grown[: old.shape[0]] = old
    return grown


def grow_replica(model: Transformer, diloco: DiLoCo, vocab_size: int) -> tuple[Transformer, DiLoCo]:
    """A new (model, DiLoCo) pair at `vocab_size` carrying all state of the old pair.

    Call it at a round boundary (model weights == θ_round), as the trainer does. The new
    DiLoCo uses the default inner optimizer and the old one's config.
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

    new_diloco = DiLoCo(grown, diloco.config, loss_fn=diloco.loss_fn)
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
