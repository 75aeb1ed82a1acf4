"""The publisher's Ed25519 key: it signs manifests; nodes pin its public key.

The publisher key is not a wallet: it is a random seed kept in a file (mode 0600) by
the operator who publishes the data set. Nodes only ever see the public key.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey


class PublisherKeyError(ValueError):
    """A publisher key file or public key that cannot be used."""


def load_or_create_signing_key(path: Path) -> tuple[SigningKey, bool]:
    """Read the hex seed at `path`, or create a new random one there (mode 0600).

    Returns the key and whether it was created now.
    """
    if path.exists():
        try:
            seed = bytes.fromhex(path.read_text(encoding="ascii").strip())
        except (ValueError, UnicodeDecodeError):
            raise PublisherKeyError(f"publisher key file {path} does not hold a hex seed") from None
        if len(seed) != 32:
            raise PublisherKeyError(f"publisher key file {path} holds {len(seed)} bytes, expected 32")
        return SigningKey(seed), False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = SigningKey.generate()
    # Written whole to a private temp file (mkstemp: mode 0600), then hard-linked into place:
    # the link is atomic and fails if another process created the key meanwhile, so the key
    # file is never half-written and never overwritten.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(bytes(key).hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return load_or_create_signing_key(path)
    finally:
        os.unlink(tmp)
    return key, True


def parse_public_key(hex_key: str) -> bytes:
    """A 32-byte Ed25519 public key from 64 hex characters, or a clear error."""
    try:
        raw = bytes.fromhex(hex_key.strip())
    except ValueError:
        raise PublisherKeyError(f"publisher key {hex_key!r} is not hex") from None
    if len(raw) != 32:
        raise PublisherKeyError(f"publisher key has {len(raw)} bytes, expected 32 (64 hex characters)")
    return raw


def signature_is_valid(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when `signature` is a valid Ed25519 signature of `message` by `public_key`; False for
    a bad signature and for a malformed key or signature."""
    try:
        VerifyKey(public_key).verify(message, signature)
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True
