"""Wallet identity as every receiver checks it: Ed25519 verification and the wallet id.

The key itself (a secret token turned into an Ed25519 seed) belongs to the node
(``neuroshard.node.wallet.Wallet``); messages here only need something that signs
(`Signer`) and the two public functions below, which node and verifier share.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

WALLET_ID_HEX_CHARS = 20
"""80 bits of sha256(public key): short enough for logs, far from accidental collisions."""


class Signer(Protocol):
    """A wallet that signs: its Ed25519 public key (hex) and detached 64-byte signatures."""

    @property
    def public_key_hex(self) -> str: ...

    def sign(self, message: bytes) -> bytes: ...


def wallet_id_of(public_key: bytes) -> str:
    """Short hex digest of a public key: the wallet's name in logs, files and the API."""
    return hashlib.sha256(public_key).hexdigest()[:WALLET_ID_HEX_CHARS]


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `message` by `public_key`."""
    try:
        VerifyKey(public_key).verify(message, signature)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True


def sha256_hex(data: bytes) -> str:
    """The hex SHA-256 of a body: how messages name the bytes they commit to."""
    return hashlib.sha256(data).hexdigest()
