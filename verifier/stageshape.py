"""A stage's model shape, read off what is checked rather than assumed from the definition.

When the publisher grows the tokenizer, every replica of stage 0 (the embedding) and of the last
stage (the head) grows its vocabulary rows at one round boundary (node.vocab), so θ, checkpoints,
segment material and state bodies of that stage hold more rows than the network definition's
`vocab_size`; the other parameters keep their shapes. A checker that built the stage at the
definition's vocabulary would refuse (or mis-replay) every honest replica of a grown stage. So each
checker builds the stage at the vocabulary its material holds (`stage_config`: from θ's length,
node.vocab.stage_vocab), never below the definition's and never past `vocab_cap`, and bounds a
body before reading it by the largest stage that cap allows (`largest_numel`). A liar gains
nothing from the choice: the material is still held to its commitments (hashes, the majority θ)
and its replay to the replayed end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from neuroshard.node.model import ModelConfig, build_stage
from neuroshard.node.vocab import holds_vocab, stage_vocab, state_vocab
from neuroshard.node.vocab import vocab_cap as grown_cap
from neuroshard.protocol.refusal import malformed
from neuroshard.protocol.schema import split_header

MAX_SAFETENSORS_HEADER = 16 << 20
"""Largest safetensors header read for a tensor's declared length (node.segment_store's bound)."""


def vocab_cap(config: ModelConfig) -> int:
    """The largest vocabulary a stage of a run defined with `config` is accepted at (node.vocab.vocab_cap:
    the verifier schedules no growth past it, and a middle stage takes no label beyond it)."""
    return grown_cap(config.vocab_size)


def stage_size(config: ModelConfig, stage: int, num_stages: int) -> tuple[int, int]:
    """(values, parameter tensors) of stage `stage` built at `config` (on the meta device: no
    weights are allocated or drawn, ~10 ms for a 125m stage)."""
    with torch.device("meta"):
        params = list(build_stage(config, stage, num_stages).parameters())
    return sum(p.numel() for p in params), len(params)


def largest_numel(config: ModelConfig, stage: int, num_stages: int) -> int:
    """The most values θ of the stage may hold: at `vocab_cap` for a stage with vocabulary rows."""
    if holds_vocab(stage, num_stages):
        config = dataclasses.replace(config, vocab_size=vocab_cap(config))
    return stage_size(config, stage, num_stages)[0]


def stage_config(config: ModelConfig, stage: int, num_stages: int, numel: int) -> ModelConfig:
    """The definition's `config` at the vocabulary of the stage whose θ holds `numel` values: the
    definition's own, or grown. ValueError (with the numbers) when no vocabulary from the
    definition's up to `vocab_cap` gives that length: another model, not a grown one."""
    with torch.device("meta"):
        vocab = stage_vocab(config, stage, num_stages, numel)
    cap = vocab_cap(config)
    if vocab is None or vocab > cap:
        base = stage_size(config, stage, num_stages)[0]
        grows = (
            f" plus rows of {config.dim} values, at a vocabulary from {config.vocab_size} to {cap}"
            if holds_vocab(stage, num_stages)
            else " (a stage without vocabulary rows never grows)"
        )
        raise ValueError(
            f"stage {stage} of {num_stages}: {numel} values is not the definition's {base}{grows}"
        )
    return config if vocab == config.vocab_size else dataclasses.replace(config, vocab_size=vocab)


def state_config(config: ModelConfig, state: Mapping[str, Tensor]) -> ModelConfig:
    """The definition's `config` at the vocabulary of a stage's state dict: its embedding's or
    head's rows (node.vocab.state_vocab). ValueError when below the definition's or past `vocab_cap`;
    loading the state checks every other shape."""
    vocab, cap = state_vocab(state, config.vocab_size), vocab_cap(config)
    if not config.vocab_size <= vocab <= cap:
        raise ValueError(
            f"a state of {vocab} vocabulary rows; this run's stages hold {config.vocab_size} to {cap}"
        )
    return config if vocab == config.vocab_size else dataclasses.replace(config, vocab_size=vocab)


def label_bound(config: ModelConfig, stage: int, num_stages: int) -> int:
    """Labels stage `stage`, built at `config` (`stage_config`'s), may receive are below this. The
    last stage scores them with its head: its rows. A middle stage holds no rows (its `config` is
    the definition's) and only passes labels on, to a head that may have grown: `vocab_cap`."""
    return config.vocab_size if stage == num_stages - 1 else vocab_cap(config)


def declared_length(body: bytes, name: str, what: str) -> int:
    """The length the safetensors header of `body` gives the 1-D tensor `name`, read before any
    tensor is: which vocabulary, and so which shapes, to decode the body at. Refused when the
    header does not parse or `name` is not a 1-D tensor in it; the decoder checks the rest."""
    header, _ = split_header(body, what, MAX_SAFETENSORS_HEADER)
    entry = header.get(name) if isinstance(header, dict) else None
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int and shape[0] >= 0):
        raise malformed(f"{what} has no 1-D tensor {name!r}")
    return int(shape[0])
