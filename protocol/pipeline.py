"""The pipeline's signed headers: an activation forward (`ActivationHeader`), its gradient back (`GradientReply`).

One signed request per micro-batch: POST /p2p/pipeline/forward carries the sender's hidden
state (B, T, C) and the labels (B, T); the 200 reply carries ∂loss/∂hidden (B, T, C) and the
loss, computed by the receiver and whatever stages follow it. Metadata is a signed JSON
header next to a safetensors body, bound to it by ``payload_sha256`` (the request signature
covers the body, not the HTTP headers, so the header signs itself like a contribution does).
The bodies' layout and codecs are the node's (``node.p2p.pipeline_wire``, ``node.actcodec``).

A micro-batch's id names it across retries and hops: the driver derives it from its wallet,
its outer round and its inner step (`micro_batch_id`), every hop forwards it unchanged, and each
sender signs it in its `ActivationHeader`. A receiver trains on an id at most once per sender.

Both headers name their recipient (`to`), so a signed header is one exchange's: a receiver refuses
one addressed to another replica, and a header shown to a third party (a sender fraud proof,
verifier.segmentcheck) says which exchange of the signer's round log it must agree with. Without
it, one micro-batch id answered to two senders (a retry elsewhere) could be held against the
signer's record of the other exchange.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated

from .schema import MAX_COUNT, MAX_STAGE, PublicKeyHex, Signed, choice, hex_bytes, integer, number, optional

FORWARD = "/p2p/pipeline/forward"
END = "/p2p/pipeline/end"
ACTIVATION_HEADER = "X-NeuroShard-Activation"
REPLY_HEADER = "X-NeuroShard-Gradient"

CODEC_NAMES = ("bf16", "fp16", "int8", "hadamard4", "hadamard43", "fitted43")
"""The pipeline codecs a header may name (``node.actcodec.CODECS`` implements exactly these)."""
ACTIVATION_DTYPES = ("bf16", "fp16")
"""The uncompressed codecs, named as the pipeline's dtypes were before codecs (`--activation-dtype`)."""
MICRO_BATCH_BYTES = 16
MAX_LOSS = 1e6

_MICRO_BATCH = hex_bytes(MICRO_BATCH_BYTES)
_STAGE = integer(1, MAX_STAGE)


@dataclass(frozen=True, kw_only=True)
class ActivationHeader(Signed):
    """One micro-batch on its way to `stage`: who sends it, its id and its shapes."""

    NAME = "activation header"
    DOMAIN = b"neuroshard/activation/v4"
    to: PublicKeyHex
    """The replica it is sent to (its wallet key): each attempt of a retry is signed anew."""
    micro_batch: Annotated[str, _MICRO_BATCH]
    """`micro_batch_id` of the driver (stage 0); kept by every hop, echoed in the reply."""
    stage: Annotated[int, _STAGE]
    """The stage that must process it (the receiver's stage)."""
    round: Annotated[int, integer(0, MAX_COUNT)]
    """The sender's outer round (rounds are per stage: informational, for logs and receipts)."""
    batch: Annotated[int, integer(1, 1 << 16)]
    seq_len: Annotated[int, integer(1, 1 << 20)]
    dim: Annotated[int, integer(1, 1 << 20)]
    codec: Annotated[str, choice(CODEC_NAMES)]
    """The run's pipeline codec: how the hidden state and the gradient sent back are packed."""
    payload_sha256: Annotated[str, hex_bytes(32)]
    network: Annotated[str | None, optional(hex_bytes(32))] = None
    """The run (its definition's digest, as SegmentCommitment.network names it): one wallet may
    train several runs, whose rounds and micro-batch ids repeat, and a header signed in one must
    not be held against the sender's log of another (verifier.segmentcheck.SenderFraudProof). A
    replica refuses a header of another run. None: a node that joined no run."""


@dataclass(frozen=True, kw_only=True)
class GradientReply(Signed):
    """The answer to a micro-batch: signed by the replica that processed it."""

    NAME = "gradient reply"
    DOMAIN = b"neuroshard/gradient/v4"
    to: PublicKeyHex
    """The replica whose micro-batch it answers (the activation header's signer)."""
    micro_batch: Annotated[str, _MICRO_BATCH]
    stage: Annotated[int, _STAGE]
    """The replier's stage."""
    round: Annotated[int, integer(0, MAX_COUNT)]
    """The replier's outer round when it stepped on this micro-batch."""
    loss: Annotated[float, number(0.0, MAX_LOSS)]
    """Mean cross-entropy of the micro-batch, computed by the last stage."""
    codec: Annotated[str, choice(CODEC_NAMES)]
    """The codec of the gradient in the body: the one of the activation header it answers."""
    payload_sha256: Annotated[str, hex_bytes(32)]
    network: Annotated[str | None, optional(hex_bytes(32))] = None
    """The run, as the activation header it answers names it."""


@dataclass(frozen=True, kw_only=True)
class PipelineEnd(Signed):
    """A replica's last word to the stage after it: it sends no more micro-batches.

    POSTed (as the signed body of POST /p2p/pipeline/end) to every replica of the next stage it
    sent work to, when its run ends (``--max-steps`` reached, or stopped). A replica that holds one
    from every replica that sent it work lately has nothing left to train on: it ends too, and
    says so to the stage after it, so a stage-0 ``--max-steps`` ends the whole pipeline."""

    NAME = "pipeline end"
    DOMAIN = b"neuroshard/pipeline-end/v1"
    stage: Annotated[int, integer(0, MAX_STAGE - 1)]
    """The sender's stage (the receiver's is the next one)."""
    round: Annotated[int, integer(0, MAX_COUNT)]
    """The sender's outer round when it ended."""
    step: Annotated[int, integer(0, MAX_COUNT)]
    """The sender's inner steps in all when it ended."""


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
