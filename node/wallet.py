"""Wallet identity: a secret token becomes an Ed25519 key; the public key is the wallet.

The token is a secret. It is read once, turned into a 32-byte seed with HKDF-SHA256
(the `cryptography` package) and dropped; only the derived keys live on. The token is
never logged, written, sent, or passed to child processes — nothing in this module
keeps it, and `Wallet.__repr__` shows only the public identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from nacl.signing import SigningKey

from neuroshard.data.keys import signature_is_valid
from neuroshard.protocol.identity import wallet_id_of

# Fixed HKDF context. Changing either string changes every wallet in the network,
# so they are versioned rather than edited.
_HKDF_SALT = b"neuroshard/wallet/salt/v1"
_HKDF_INFO = b"neuroshard/wallet/ed25519-seed/v1"

WALLET_ID_HEX_CHARS = 20
"""80 bits of sha256(public key): short enough for logs, far from accidental collisions."""

TOKEN_ENV = "NEUROSHARD_TOKEN"


class TokenError(ValueError):
    """No usable token was given (the message never contains the token)."""


def derive_seed(token: str) -> bytes:
    """32-byte Ed25519 seed from the token: HKDF-SHA256 with a fixed salt and context."""
    if not token:
        raise TokenError("the token is empty")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=_HKDF_SALT, info=_HKDF_INFO)
    return hkdf.derive(token.encode("utf-8"))


@dataclass(frozen=True)
class Wallet:
    """A node's identity. Holds the signing key, never the token."""

    _signing_key: SigningKey = field(repr=False)

    @classmethod
    def from_token(cls, token: str) -> Wallet:
        return cls(SigningKey(derive_seed(token)))

    @property
    def public_key(self) -> bytes:
        return bytes(self._signing_key.verify_key)

    @property
    def public_key_hex(self) -> str:
        return self.public_key.hex()

    @property
    def wallet_id(self) -> str:
        return wallet_id_of(self.public_key)

    def sign(self, message: bytes) -> bytes:
        """Detached 64-byte Ed25519 signature over `message`."""
        return self._signing_key.sign(message).signature

    def __repr__(self) -> str:
        return f"Wallet(wallet_id={self.wallet_id!r})"


verify = signature_is_valid
"""True when `signature` is a valid Ed25519 signature of `message` by `public_key`: the one check
of wallet and publisher signatures alike (data.keys)."""


def resolve_token(flag_token: str | None, token_file: Path | None, env: dict[str, str]) -> str:
    """Pick the token from --token, --token-file or NEUROSHARD_TOKEN, in that order.

    `env` is passed in (not read from os.environ here) so the CLI stays the only place
    that touches the process environment.
    """
    if flag_token:
        return flag_token
    if token_file is not None:
        try:
            text = token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise TokenError(f"cannot read token file {token_file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise TokenError(f"token file {token_file} is not UTF-8 text") from None
        if not text:
            raise TokenError(f"token file {token_file} is empty")
        _refuse_if_readable_by_others(token_file)
        return text
    from_env = env.get(TOKEN_ENV, "")
    if from_env:
        return from_env
    raise TokenError(f"no token: pass --token, --token-file or set {TOKEN_ENV}")


def _refuse_if_readable_by_others(path: Path) -> None:
    mode = os.stat(path).st_mode
    if mode & 0o077:
        raise TokenError(
            f"token file {path} is readable by other users (mode {mode & 0o777:o}); chmod 600 it"
        )
