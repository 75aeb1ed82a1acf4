"""The pipeline's safetensors bodies: activations forward, activation gradients back, in the run's codec.

The signed headers that travel next to them (`ActivationHeader`, `GradientReply`) and the
route are ``neuroshard.protocol.pipeline``; this module packs and unpacks the tensors they
bind by ``payload_sha256`` and checks a body against its header.

Activations and gradients travel through the run's codec (`node.actcodec`, named in the signed
network definition and in every header): ``fitted43`` by default (4 bits forward in codes
fitted to each group, 3 back in dithered ones, after a fixed rotation of each group), ``int8``
(absmax in groups of 64 along C, bf16 scales: 8.25 bits per value), ``hadamard4`` (4 bits
forward, 6 back), ``hadamard43`` (4 forward, 3 back), or the uncompressed casts ``bf16`` and
``fp16``. The
packed codes and scales are tensors of the same safetensors body; decoding is a pure function of
the bytes. Labels travel as int32 (-100 = ignored position), never as floats.
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from neuroshard.protocol.pipeline import CODEC_NAMES, ActivationHeader
from neuroshard.protocol.refusal import invalid, malformed

from .. import actcodec
from ..actcodec import CODECS, DEFAULT_CODEC, Codec, PayloadError
from ..codec import HEADER_SLACK, Layout, check_layout

if tuple(sorted(CODECS)) != tuple(sorted(CODEC_NAMES)):
    raise ImportError(f"actcodec implements {sorted(CODECS)}, the protocol names {sorted(CODEC_NAMES)}")

LABEL_BYTES = 4
"""Labels are int32 on the wire."""
IGNORE_LABEL = -100
HIDDEN = "hidden"
LABELS = "labels"
GRAD = "grad"


def pipeline_codec(name: str) -> Codec:
    """The codec named in a header; Refused if there is none of that name."""
    if name not in CODECS:
        raise invalid(f"pipeline codec {name!r} is not one of {', '.join(CODEC_NAMES)}")
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
        raise malformed(f"safetensors body does not load: {exc}") from None


def _encode(x: Tensor, fmt: actcodec.Format, name: str, what: str) -> dict[str, Tensor]:
    try:
        return actcodec.encode(x, fmt, name)
    except ValueError as exc:
        raise invalid(f"{what}: {exc}") from None


def _decode(tensors: dict[str, Tensor], fmt: actcodec.Format, name: str, shape: tuple[int, ...]) -> Tensor:
    try:
        return actcodec.decode(tensors, fmt, name, shape)
    except PayloadError as exc:
        raise invalid(str(exc)) from None


def encode_activations(hidden: Tensor, labels: Tensor, codec: str) -> bytes:
    """hidden (B, T, C) finite floats, labels (B, T) integers -> safetensors bytes in `codec`
    (Refused if hidden has NaN or inf: nothing a receiver could train on)."""
    if labels.is_floating_point():
        raise ValueError(f"labels must be integer token ids, got {labels.dtype}")
    tensors = _encode(hidden, pipeline_codec(codec).forward, HIDDEN, "hidden state")
    return st_save({**tensors, LABELS: labels.detach().to(torch.int32).contiguous()})


def decode_activations(data: bytes, header: ActivationHeader, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Safetensors bytes -> (hidden (B, T, C) float32, labels (B, T) int64), checked against the header:
    exact layout (Refused "malformed"), codes, scales and decoded hidden state valid and finite,
    labels in [0, vocab) or -100 (Refused "invalid")."""
    return decode_activations_as(data, (header.batch, header.seq_len, header.dim), header.codec, vocab_size)


def decode_activations_as(
    data: bytes, shape: tuple[int, int, int], codec: str, vocab_size: int
) -> tuple[Tensor, Tensor]:
    """`decode_activations` for a payload whose shape and codec are known without its header (a
    segment check reading what a replica says it sent)."""
    check_layout(data, activation_layout(*shape, codec))
    tensors = _load(data)
    hidden = _decode(tensors, pipeline_codec(codec).forward, HIDDEN, shape)
    labels = tensors[LABELS].long()
    bad = (labels != IGNORE_LABEL) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise invalid(f"{int(bad.sum())} labels outside [0, {vocab_size}) and not {IGNORE_LABEL}")
    return hidden, labels


def encode_gradient(grad: Tensor, codec: str) -> bytes:
    """∂loss/∂hidden (B, T, C) -> safetensors bytes in `codec`; Refused if not finite."""
    return st_save(_encode(grad, pipeline_codec(codec).backward, GRAD, "gradient"))


def decode_gradient(data: bytes, shape: tuple[int, int, int], codec: str) -> Tensor:
    """Safetensors bytes -> ∂loss/∂hidden float32 of exactly `shape`, all finite."""
    check_layout(data, gradient_layout(*shape, codec))
    return _decode(_load(data), pipeline_codec(codec).backward, GRAD, shape)
