"""Signed HTTP requests to the verifier: the peer plane's scheme (node.p2p), checked for FastAPI.

One wire format for every signed request in NeuroShard, defined in `node.p2p.wire` and
signed by `node.p2p.auth.sign_request`: the signer's Ed25519 key signs

    neuroshard/request/v1 \\n METHOD \\n PATH \\n sha256(body) hex \\n TIMESTAMP_MS \\n NONCE

(`node.p2p.wire.request_signing_bytes`; PATH is the raw path with its query string as sent,
TIMESTAMP_MS Unix time in integer milliseconds, NONCE 32 lower-case hex characters never
reused by this signer), and four headers carry it:

    X-NeuroShard-Wallet      the signer's public key, 64 lower-case hex characters
    X-NeuroShard-Timestamp   TIMESTAMP_MS
    X-NeuroShard-Nonce       NONCE
    X-NeuroShard-Signature   the 64-byte Ed25519 signature, 128 lower-case hex characters

A node calls the verifier exactly as it calls a peer. The verifier accepts a timestamp
within ±`window_s` (60 s) of its own clock and remembers every nonce in its database until
the timestamp has left the window (verifier.ledger.use_nonce, in the same transaction as the
write), so a captured request can be replayed neither later (stale) nor now (nonce seen),
not even across a restart.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from neuroshard.node.p2p.auth import REPLAY_WINDOW_S
from neuroshard.node.p2p.auth import sign_request as p2p_sign_request
from neuroshard.node.p2p.wire import (
    NONCE_BYTES,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
    request_signing_bytes,
)
from neuroshard.node.wallet import Wallet, verify, wallet_id_of

__all__ = [
    "FRESHNESS_WINDOW_S",
    "NONCE_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WALLET_HEADER",
    "AuthError",
    "SignedBy",
    "new_nonce",
    "sign_request",
    "signing_message",
    "verify_request",
]

FRESHNESS_WINDOW_S = REPLAY_WINDOW_S
"""Largest accepted |timestamp − receiver's clock|, the same on the peer plane and the verifier."""

_PUBLIC_KEY = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(rf"[0-9a-f]{{{2 * NONCE_BYTES}}}")
_SIGNATURE = re.compile(r"[0-9a-f]{128}")
_TIMESTAMP_MS = re.compile(r"[0-9]{1,16}")


class AuthError(Exception):
    """A request that is unsigned, malformed, stale or forged; `status` is the HTTP code to answer."""

    def __init__(self, detail: str, status: int = 401) -> None:
        super().__init__(detail)
        self.detail = detail
        self.status = status


@dataclass(frozen=True)
class SignedBy:
    """Who signed a verified request, and the nonce and timestamp (Unix seconds) they used."""

    public_key_hex: str
    timestamp: float
    nonce: str

    @property
    def wallet_id(self) -> str:
        return wallet_id_of(bytes.fromhex(self.public_key_hex))


def signing_message(method: str, path: str, body: bytes, timestamp_ms: str, nonce: str) -> bytes:
    return request_signing_bytes(method, path, hashlib.sha256(body).hexdigest(), timestamp_ms, nonce)


def new_nonce() -> str:
    """A fresh nonce in the wire format (NONCE_BYTES random bytes as hex)."""
    return secrets.token_hex(NONCE_BYTES)


def sign_request(signer: Wallet, method: str, path: str, body: bytes, *, now: float) -> dict[str, str]:
    """The four headers that authenticate `body` sent as `method path` at Unix time `now`."""
    return p2p_sign_request(signer, method, path, body, now)


def _header(headers: Mapping[str, str], name: str, pattern: re.Pattern[str], what: str) -> str:
    value = headers.get(name)
    if value is None:
        raise AuthError(f"unsigned request: missing {name} header")
    if not pattern.fullmatch(value):
        raise AuthError(f"malformed {name} header: expected {what}")
    return value


def verify_request(
    headers: Mapping[str, str],
    method: str,
    path: str,
    body: bytes,
    *,
    now: float,
    window_s: float = FRESHNESS_WINDOW_S,
) -> SignedBy:
    """Check the four headers against the request; raise AuthError (401) on any failure.

    `path` is the path as sent, with its query string if any. The nonce is only checked for
    shape here; whether it was used before is the store's job (it must be remembered in
    the same transaction as the write it authorises).
    """
    public_key = _header(headers, WALLET_HEADER, _PUBLIC_KEY, "64 lower-case hex characters")
    timestamp_ms = _header(headers, TIMESTAMP_HEADER, _TIMESTAMP_MS, "Unix time in integer milliseconds")
    nonce = _header(headers, NONCE_HEADER, _NONCE, f"{2 * NONCE_BYTES} lower-case hex characters")
    signature = _header(headers, SIGNATURE_HEADER, _SIGNATURE, "128 lower-case hex characters")
    timestamp = int(timestamp_ms) / 1000.0
    skew = timestamp - now
    if abs(skew) > window_s:
        raise AuthError(
            f"stale request: timestamp {timestamp:.3f} is {skew:+.1f} s from the verifier's clock "
            f"(accepted window ±{window_s:.0f} s)"
        )
    message = signing_message(method, path, body, timestamp_ms, nonce)
    if not verify(bytes.fromhex(public_key), message, bytes.fromhex(signature)):
        raise AuthError(f"bad signature for {method.upper()} {path} by {public_key[:16]}…")
    return SignedBy(public_key_hex=public_key, timestamp=timestamp, nonce=nonce)
