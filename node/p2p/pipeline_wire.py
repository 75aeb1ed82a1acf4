"""The messages of the pipeline: activations forward, activation gradients back — defined once.

One signed request per micro-batch: POST /p2p/pipeline/forward carries the sender's hidden
state (B, T, C) and the labels (B, T); the 200 reply carries ∂loss/∂hidden (B, T, C) and the
loss, computed by the receiver and whatever stages follow it. Metadata is a signed JSON
header next to a safetensors body, bound to it by ``payload_sha256`` (the request signature
covers the body, not the HTTP headers, so the header signs itself like a contribution does).

Activations and gradients travel through the run's codec (`node.actcodec`, named in the signed
network definition and in every header): ``int8`` by default (absmax in groups of 64 along C,
bf16 scales: 8.25 bits per value), ``hadamard4`` (4 bits forward, 6 back, after a fixed rotation
of each group), or the uncompressed casts ``bf16`` and ``fp16``. The packed codes and scales are
tensors of the same safetensors body; decoding is a pure function of the bytes. Labels travel
as int32 (-100 = ignored position), never as floats.

A micro-batch's id names it across retries and hops: the driver derives it from its wallet,
its outer round and its inner step (`micro_batch_id`), every hop forwards it unchanged, and each
sender signs it in its `ActivationHeader`. A receiver trains on an id at most once per sender
(`p2p.pipeline.PipelineService`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .. import actcodec
from ..actcodec import CODECS, DEFAULT_CODEC, Codec, PayloadError
from .codec import HEADER_SLACK, Layout, check_layout
from .wire import (
    MAX_COUNT,
    MAX_STAGE,
    InvalidMessage,
    MalformedMessage,
    Signed,
    choice,
    hex_bytes,
    integer,
    number,
    schema,
)

FORWARD = "/p2p/pipeline/forward"
ACTIVATION_HEADER = "X-NeuroShard-Activation"
REPLY_HEADER = "X-NeuroShard-Gradient"

CODEC_NAMES = tuple(CODECS)
ACTIVATION_DTYPES = ("bf16", "fp16")
"""The uncompressed codecs, named as the pipeline's dtypes were before codecs (`--activation-dtype`)."""
LABEL_BYTES = 4
"""Labels are int32 on the wire."""
MICRO_BATCH_BYTES = 16
MAX_LOSS = 1e6
IGNORE_LABEL = -100
HIDDEN = "hidden"
LABELS = "labels"
GRAD = "grad"
_SIGNER = schema(wallet=hex_bytes(32), signature=hex_bytes(64))


@dataclass(frozen=True, kw_only=True)
class ActivationHeader(Signed):
    """One micro-batch on its way to `stage`: who sends it, its id and its shapes."""

    NAME = "activation header"
    DOMAIN = b"neuroshard/activation/v2"
    micro_batch: str
    """`micro_batch_id` of the driver (stage 0); kept by every hop, echoed in the reply."""
    stage: int
    """The stage that must process it (the receiver's stage)."""
    round: int
    """The sender's outer round (rounds are per stage: informational, for logs and receipts)."""
    batch: int
    seq_len: int
    dim: int
    codec: str
    """The run's pipeline codec (`actcodec.CODECS`): how the hidden state and the gradient sent back are packed."""
    payload_sha256: str

    FIELDS = schema(
        _SIGNER,
        micro_batch=hex_bytes(MICRO_BATCH_BYTES),
        stage=integer(1, MAX_STAGE),
        round=integer(0, MAX_COUNT),
        batch=integer(1, 1 << 16),
        seq_len=integer(1, 1 << 20),
        dim=integer(1, 1 << 20),
        codec=choice(CODEC_NAMES),
        payload_sha256=hex_bytes(32),
    )


@dataclass(frozen=True, kw_only=True)
class GradientReply(Signed):
    """The answer to a micro-batch: signed by the replica that processed it."""

    NAME = "gradient reply"
    DOMAIN = b"neuroshard/gradient/v2"
    micro_batch: str
    stage: int
    """The replier's stage."""
    round: int
    """The replier's outer round when it stepped on this micro-batch."""
    loss: float
    """Mean cross-entropy of the micro-batch, computed by the last stage."""
    codec: str
    """The codec of the gradient in the body: the one of the activation header it answers."""
    payload_sha256: str

    FIELDS = schema(
        _SIGNER,
        micro_batch=hex_bytes(MICRO_BATCH_BYTES),
        stage=integer(1, MAX_STAGE),
        round=integer(0, MAX_COUNT),
        loss=number(0.0, MAX_LOSS),
        codec=choice(CODEC_NAMES),
        payload_sha256=hex_bytes(32),
    )


def micro_batch_id(driver_wallet_hex: str, round_: int, sequence: int) -> str:
    """The id of the driver's micro-batch number `sequence` (its inner step) of outer round `round_`.

    Derived, not random: a retry after a lost reply, and a driver resumed from a checkpoint that
    redoes a step, send the same id, so a replica that already trained on it does not train again."""
    if not (0 <= round_ < 1 << 63 and 0 <= sequence < 1 << 63):
        raise ValueError(f"round {round_} and sequence {sequence} must lie in [0, 2**63)")
    digest = hashlib.sha256(
        b"neuroshard/micro-batch/v1" + bytes.fromhex(driver_wallet_hex)
        + round_.to_bytes(8, "big") + sequence.to_bytes(8, "big")
    )  # fmt: skip
    return digest.hexdigest()[: 2 * MICRO_BATCH_BYTES]


def pipeline_codec(name: str) -> Codec:
    """The codec named in a header; InvalidMessage if there is none of that name."""
    if name not in CODECS:
        raise InvalidMessage(f"pipeline codec {name!r} is not one of {', '.join(CODEC_NAMES)}")
    return CODECS[name]


def activation_layout(batch: int, seq_len: int, dim: int, codec: str) -> Layout:
    shape = (batch, seq_len, dim)
    return {
        **actcodec.layout(pipeline_codec(codec).forward, HIDDEN, shape),
        LABELS: ("I32", (batch, seq_len)),
    }


def gradient_layout(batch: int, seq_len: int, dim: int, codec: str) -> Layout:
    return actcodec.layout(pipeline_codec(codec).backward, GRAD, (batch, seq_len, dim))


def bytes_per_token(codec: str, dim: int) -> tuple[int, int]:
    """(forward, backward) payload bytes per token at one stage boundary: the packed hidden state
    plus its int32 label, and the packed gradient (safetensors headers not counted)."""
    c = pipeline_codec(codec)
    return c.forward.bytes_per_row(dim) + LABEL_BYTES, c.backward.bytes_per_row(dim)


def activation_size_bound(max_batch: int, max_seq_len: int, dim: int, codec: str = DEFAULT_CODEC) -> int:
    """Largest forward body in `codec`: packed hidden state plus int32 labels."""
    return max_batch * max_seq_len * bytes_per_token(codec, dim)[0] + HEADER_SLACK


def gradient_size_bound(batch: int, seq_len: int, dim: int, codec: str) -> int:
    """The exact-layout bound on a reply body for a micro-batch of (batch, seq_len, dim)."""
    return batch * seq_len * bytes_per_token(codec, dim)[1] + HEADER_SLACK


def _load(data: bytes) -> dict[str, Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise MalformedMessage(f"safetensors body does not load: {exc}") from None


def _encode(x: Tensor, fmt: actcodec.Format, name: str, what: str) -> dict[str, Tensor]:
    try:
        return actcodec.encode(x, fmt, name)
    except ValueError as exc:
        raise InvalidMessage(f"{what}: {exc}") from None


def _decode(tensors: dict[str, Tensor], fmt: actcodec.Format, name: str, shape: tuple[int, ...]) -> Tensor:
    try:
        return actcodec.decode(tensors, fmt, name, shape)
    except PayloadError as exc:
        raise InvalidMessage(str(exc)) from None


def encode_activations(hidden: Tensor, labels: Tensor, codec: str) -> bytes:
    """hidden (B, T, C) finite floats, labels (B, T) integers -> safetensors bytes in `codec`
    (InvalidMessage if hidden has NaN or inf: nothing a receiver could train on)."""
    if labels.is_floating_point():
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    tensors = _encode(hidden, pipeline_codec(codec).forward, HIDDEN, "hidden state")
    return st_save({**tensors, LABELS: labels.detach().to(torch.int32).contiguous()})


def decode_activations(data: bytes, header: ActivationHeader, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Safetensors bytes -> (hidden (B, T, C) float32, labels (B, T) int64), checked against the header:
    exact layout (MalformedMessage, 400), codes, scales and decoded hidden state valid and finite,
    labels in [0, vocab) or -100 (InvalidMessage, 422)."""
    shape = (header.batch, header.seq_len, header.dim)
    check_layout(data, activation_layout(*shape, header.codec))
    tensors = _load(data)
    hidden = _decode(tensors, pipeline_codec(header.codec).forward, HIDDEN, shape)
    labels = tensors[LABELS].long()
    bad = (labels != IGNORE_LABEL) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise InvalidMessage(f"{int(bad.sum())} labels outside [0, {vocab_size}) and not {IGNORE_LABEL}")
    return hidden, labels


def encode_gradient(grad: Tensor, codec: str) -> bytes:
    """∂loss/∂hidden (B, T, C) -> safetensors bytes in `codec`; InvalidMessage if not finite."""
    return st_save(_encode(grad, pipeline_codec(codec).backward, GRAD, "gradient"))


def decode_gradient(data: bytes, shape: tuple[int, int, int], codec: str) -> Tensor:
    """Safetensors bytes -> ∂loss/∂hidden float32 of exactly `shape`, all finite."""
    check_layout(data, gradient_layout(*shape, codec))
    return _decode(_load(data), pipeline_codec(codec).backward, GRAD, shape)
