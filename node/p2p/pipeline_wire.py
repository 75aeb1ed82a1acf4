"""The messages of the pipeline: activations forward, activation gradients back — defined once.

One signed request per micro-batch: POST /p2p/pipeline/forward carries the sender's hidden
state (B, T, C) and the labels (B, T); the 200 reply carries ∂loss/∂hidden (B, T, C) and the
loss, computed by the receiver and whatever stages follow it. Metadata is a signed JSON
header next to a safetensors body, bound to it by ``payload_sha256`` (the request signature
covers the body, not the HTTP headers, so the header signs itself like a contribution does).

Activations and gradients travel in bf16 (default: fp32's exponent range, so small gradients
do not underflow) or fp16; labels as int32 (-100 = ignored position).

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

from .codec import HEADER_SLACK, Layout, all_finite, check_layout
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

ACTIVATION_DTYPES = ("bf16", "fp16")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_ST_DTYPES = {"bf16": "BF16", "fp16": "F16"}
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
    DOMAIN = b"neuroshard/activation/v1"
    micro_batch: str
    """`micro_batch_id` of the driver (stage 0); kept by every hop, echoed in the reply."""
    stage: int
    """The stage that must process it (the receiver's stage)."""
    round: int
    """The sender's outer round (rounds are per stage: informational, for logs and receipts)."""
    batch: int
    seq_len: int
    dim: int
    dtype: str
    """"bf16" or "fp16": the dtype of the hidden state and of the gradient sent back."""
    payload_sha256: str

    FIELDS = schema(
        _SIGNER,
        micro_batch=hex_bytes(MICRO_BATCH_BYTES),
        stage=integer(1, MAX_STAGE),
        round=integer(0, MAX_COUNT),
        batch=integer(1, 1 << 16),
        seq_len=integer(1, 1 << 20),
        dim=integer(1, 1 << 20),
        dtype=choice(ACTIVATION_DTYPES),
        payload_sha256=hex_bytes(32),
    )


@dataclass(frozen=True, kw_only=True)
class GradientReply(Signed):
    """The answer to a micro-batch: signed by the replica that processed it."""

    NAME = "gradient reply"
    DOMAIN = b"neuroshard/gradient/v1"
    micro_batch: str
    stage: int
    """The replier's stage."""
    round: int
    """The replier's outer round when it stepped on this micro-batch."""
    loss: float
    """Mean cross-entropy of the micro-batch, computed by the last stage."""
    dtype: str
    payload_sha256: str

    FIELDS = schema(
        _SIGNER,
        micro_batch=hex_bytes(MICRO_BATCH_BYTES),
        stage=integer(1, MAX_STAGE),
        round=integer(0, MAX_COUNT),
        loss=number(0.0, MAX_LOSS),
        dtype=choice(ACTIVATION_DTYPES),
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


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in _TORCH_DTYPES:
        raise InvalidMessage(f"activation dtype {dtype!r} is not one of {', '.join(ACTIVATION_DTYPES)}")
    return _TORCH_DTYPES[dtype]


def activation_layout(batch: int, seq_len: int, dim: int, dtype: str) -> Layout:
    return {HIDDEN: (_ST_DTYPES[dtype], (batch, seq_len, dim)), LABELS: ("I32", (batch, seq_len))}


def gradient_layout(batch: int, seq_len: int, dim: int, dtype: str) -> Layout:
    return {GRAD: (_ST_DTYPES[dtype], (batch, seq_len, dim))}


def activation_size_bound(max_batch: int, max_seq_len: int, dim: int) -> int:
    """Largest forward body: hidden at 2 bytes per value plus int32 labels."""
    return max_batch * max_seq_len * (2 * dim + 4) + HEADER_SLACK


def _load(data: bytes) -> dict[str, Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise MalformedMessage(f"safetensors body does not load: {exc}") from None


def _finite(x: Tensor, what: str) -> Tensor:
    values = x.float().reshape(-1)
    if not all_finite(values):
        raise InvalidMessage(f"{what} has non-finite values (NaN or inf)")
    return x


def encode_activations(hidden: Tensor, labels: Tensor, dtype: str) -> bytes:
    """hidden (B, T, C) any float dtype, labels (B, T) integer -> safetensors bytes."""
    return st_save(
        {
            HIDDEN: hidden.detach().to(torch_dtype(dtype)).contiguous(),
            LABELS: labels.detach().to(torch.int32).contiguous(),
        }
    )


def decode_activations(data: bytes, header: ActivationHeader, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Safetensors bytes -> (hidden (B, T, C) float32, labels (B, T) int64), checked against the header:
    exact layout (MalformedMessage, 400), finite hidden and labels in [0, vocab) or -100 (InvalidMessage, 422)."""
    check_layout(data, activation_layout(header.batch, header.seq_len, header.dim, header.dtype))
    tensors = _load(data)
    hidden = _finite(tensors[HIDDEN], "hidden state").float()
    labels = tensors[LABELS].long()
    bad = (labels != IGNORE_LABEL) & ((labels < 0) | (labels >= vocab_size))
    if bool(bad.any()):
        raise InvalidMessage(f"{int(bad.sum())} labels outside [0, {vocab_size}) and not {IGNORE_LABEL}")
    return hidden, labels


def encode_gradient(grad: Tensor, dtype: str) -> bytes:
    return st_save({GRAD: _finite(grad.detach(), "gradient").to(torch_dtype(dtype)).contiguous()})


def decode_gradient(data: bytes, shape: tuple[int, int, int], dtype: str) -> Tensor:
    """Safetensors bytes -> ∂loss/∂hidden float32 of exactly `shape`, all finite."""
    check_layout(data, gradient_layout(*shape, dtype))
    return _finite(_load(data)[GRAD], "gradient").float()
