"""The run's definition (`network.toml`), and the operator key that signs it.

The verifier owns the definition and serves it at GET /api/network as canonical JSON
(sorted keys, no spaces) with an Ed25519 signature of exactly those bytes by the operator
key, so a joining node can check it against the operator key it was given. A minimal file:

    name = "demo"

    [model]              # node.model.ModelConfig: a preset `size` and/or any of its fields
    size = "tiny"
    vocab_size = 4096

    [stages]
    count = 1            # pipeline stages; 1 = plain DiLoCo data parallelism
    codec = "fitted43"   # activations and gradients between stages (node.actcodec.CODECS:
                         # "fitted43" default when count > 1, "int8", "hadamard4",
                         # "hadamard43", "bf16", "fp16");
                         # unused at count = 1

    [diloco]             # node.diloco.DiLoCoConfig fields (defaults where omitted)
    inner_steps = 100
    outer_warmup_rounds = 3  # the outer lr ramps over the first rounds; 3 when omitted
                             # (node.network_definition.DEFAULT_OUTER_WARMUP_ROUNDS)

    [training]
    batch_size = 8       # sequences per inner step (spot checks replay with these)
    seq_len = 128
    segment_steps = 2    # k of the segment checks (node.segments); omitted: inner_steps / 40
                         # (at least 1); set it higher to keep fewer checkpoints on disk, and
                         # the verifier's checks cost more (verifier.budget)

    [aggregation]
    rule = "default"     # node.aggregation: a rule name, "default" or "nnm+<rule>"
    f = 0                # tolerated Byzantine replicas per stage
    anchor_floor = 0.1   # anchored rounds (node.outer.reduce.AnchorCheck): 0.1 when omitted and
                         # outer momentum > 0; false turns it off
    clip_scale = 1.25    # centered clipping (the default rule for n >= 5): tau = this x the median
    clip_iterations = 3  # distance, this many passes; 1.25 and 3 when omitted (node.aggregation)

    [data]
    manifest_url = "https://cdn.example.org/neuroshard/"
    publisher_key = "<64 hex>"

    [evaluation]
    every_rounds = 5     # measure the held-out loss every this many rounds
    held_out_shard = 0   # the shard it is measured on; nodes never train on it
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

from nacl.signing import SigningKey

from neuroshard.data.keys import load_or_create_signing_key
from neuroshard.node.network_definition import (
    LEGACY_SEGMENTS_PER_ROUND,
    NETWORK_FORMAT,
    NETWORK_SIGNATURE_HEADER,
    OPERATOR_HEADER,
    NetworkDefinition,
    NetworkError,
    parse_network,
    sign_network,
    verify_network,
)
from neuroshard.node.wallet import Wallet

__all__ = [
    "LEGACY_SEGMENTS_PER_ROUND",
    "NETWORK_FORMAT",
    "NETWORK_SIGNATURE_HEADER",
    "OPERATOR_HEADER",
    "NetworkDefinition",
    "NetworkError",
    "load_network",
    "load_operator_key",
    "parse_network",
    "sign_network",
    "verify_network",
]


def load_network(path: Path) -> NetworkDefinition:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise NetworkError(f"cannot read network definition {path}: {exc.strerror}") from None
    try:
        doc = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise NetworkError(f"{path} is not valid TOML: {exc}") from None
    return parse_network(doc, str(path))


def load_operator_key(path: Path, *, create: bool = False) -> Wallet:
    """The operator's signing key: a hex Ed25519 seed in a file (mode 0600), as a signer.

    With create=True a missing file is created with a fresh random key; otherwise a
    missing file is an error (a typo must not silently mint a new operator identity).
    """
    if not path.exists():
        if not create:
            raise NetworkError(
                f"operator key file {path} does not exist (create one with --init-operator-key)"
            )
        key, _ = load_or_create_signing_key(path)
        return Wallet(SigningKey(bytes(key)))
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise NetworkError(f"cannot read operator key file {path}: {exc}") from None
    mode = os.stat(path).st_mode
    if mode & 0o077:
        raise NetworkError(
            f"operator key file {path} is readable by other users (mode {mode & 0o777:o}); chmod 600 it"
        )
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        raise NetworkError(f"operator key file {path} must hold a 32-byte seed as 64 hex characters")
    return Wallet(SigningKey(bytes.fromhex(text)))
