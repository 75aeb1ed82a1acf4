"""Signed requests, transport-free: signing bytes, headers, freshness, anti-replay nonces, verification.

Every request between processes (node to peer, node to verifier) is signed the same way.
The signer's Ed25519 key signs

    neuroshard/request/v1 \\n METHOD \\n PATH \\n sha256(body) hex \\n TIMESTAMP_MS \\n NONCE

(`request_signing_bytes`; PATH is the raw path with its query string as sent, TIMESTAMP_MS
Unix time in integer milliseconds, NONCE 32 lowercase hex characters never reused by this
signer), and four headers carry it:

    X-NeuroShard-Wallet      the signer's public key, 64 lowercase hex characters
    X-NeuroShard-Timestamp   TIMESTAMP_MS
    X-NeuroShard-Nonce       NONCE
    X-NeuroShard-Signature   the 64-byte Ed25519 signature, 128 lowercase hex characters

A receiver takes a timestamp within ±`FRESHNESS_WINDOW_S` of its own clock and each
(wallet, nonce) once inside that window: a peer in memory (`NonceCache`), the verifier in
its database, in the same transaction as the write. `verify_request` returns the signer or
raises `Refused` (unsigned, bad_auth, stale, bad_signature); the HTTP adapters
(``node.p2p.auth``, ``api.writes``) only read headers and bodies and choose statuses.
"""

from __future__ import annotations

import hashlib
import heapq
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from .identity import Signer, verify, wallet_id_of
from .refusal import BAD_AUTH, BAD_SIGNATURE, BUSY, STALE, UNSIGNED, Refused

WALLET_HEADER = "X-NeuroShard-Wallet"
TIMESTAMP_HEADER = "X-NeuroShard-Timestamp"
NONCE_HEADER = "X-NeuroShard-Nonce"
SIGNATURE_HEADER = "X-NeuroShard-Signature"
AUTH_HEADERS = (WALLET_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
REQUEST_DOMAIN = b"neuroshard/request/v1"
NONCE_BYTES = 16
FRESHNESS_WINDOW_S = 60.0
"""Largest accepted |timestamp − receiver's clock| (issue 4), the same on the peer plane and the verifier."""

_PUBLIC_KEY = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(rf"[0-9a-f]{{{2 * NONCE_BYTES}}}")
_SIGNATURE = re.compile(r"[0-9a-f]{128}")
_TIMESTAMP_MS = re.compile(r"[0-9]{1,16}")


def request_signing_bytes(method: str, path: str, body_sha256: str, timestamp_ms: str, nonce: str) -> bytes:
    """``method\\npath\\nsha256(body)\\ntimestamp\\nnonce`` under the request domain."""
    lines = (method.upper(), path, body_sha256, timestamp_ms, nonce)
    return REQUEST_DOMAIN + b"\n" + "\n".join(lines).encode("utf-8")


def new_nonce() -> str:
    """A fresh nonce in the wire format (NONCE_BYTES random bytes as hex)."""
    return secrets.token_hex(NONCE_BYTES)


def sign_request(signer: Signer, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
    """The four headers that authenticate `body` sent as `method path` at Unix time `now`."""
    timestamp = str(int(now * 1000))
    nonce = new_nonce()
    message = request_signing_bytes(method, path, hashlib.sha256(body).hexdigest(), timestamp, nonce)
    return {
        WALLET_HEADER: signer.public_key_hex,
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: signer.sign(message).hex(),
    }


@dataclass(frozen=True)
class AuthHeaders:
    """The four auth headers, checked for shape (not yet for freshness or signature)."""

    public_key_hex: str
    timestamp_ms: str
    nonce: str
    signature: bytes

    @property
    def timestamp(self) -> float:
        return int(self.timestamp_ms) / 1000.0


def _header(headers: Mapping[str, str], name: str, pattern: re.Pattern[str], what: str) -> str:
    value = headers[name]
    if not pattern.fullmatch(value):
        raise Refused(BAD_AUTH, f"{name} must be {what}")
    return value


def parse_auth_headers(headers: Mapping[str, str]) -> AuthHeaders:
    """The four headers from a case-insensitive mapping; Refused unsigned / bad_auth."""
    missing = [h for h in AUTH_HEADERS if h not in headers]
    if missing:
        raise Refused(UNSIGNED, f"missing auth header(s) {', '.join(missing)}")
    return AuthHeaders(
        _header(headers, WALLET_HEADER, _PUBLIC_KEY, "64 lowercase hex characters"),
        _header(headers, TIMESTAMP_HEADER, _TIMESTAMP_MS, "Unix time in integer milliseconds"),
        _header(headers, NONCE_HEADER, _NONCE, f"{2 * NONCE_BYTES} lowercase hex characters"),
        bytes.fromhex(_header(headers, SIGNATURE_HEADER, _SIGNATURE, "128 lowercase hex characters")),
    )


def check_fresh(auth: AuthHeaders, *, now: float, window_s: float = FRESHNESS_WINDOW_S) -> None:
    """Refused("stale") when the timestamp is further than `window_s` from `now`."""
    skew = auth.timestamp - now
    if abs(skew) > window_s:
        raise Refused(
            STALE,
            f"stale request: timestamp {auth.timestamp:.3f} is {skew:+.1f} s from the receiver's clock "
            f"(allowed ±{window_s:.0f} s)",
        )


@dataclass(frozen=True)
class SignedBy:
    """Who signed a verified request, and the nonce and timestamp (Unix seconds) they used."""

    public_key_hex: str
    timestamp: float
    nonce: str

    @property
    def wallet_id(self) -> str:
        return wallet_id_of(bytes.fromhex(self.public_key_hex))


def check_signature(auth: AuthHeaders, method: str, path: str, body: bytes) -> SignedBy:
    """Refused("bad_signature") unless the headers' signature covers this request."""
    message = request_signing_bytes(
        method, path, hashlib.sha256(body).hexdigest(), auth.timestamp_ms, auth.nonce
    )
    if not verify(bytes.fromhex(auth.public_key_hex), message, auth.signature):
        raise Refused(
            BAD_SIGNATURE, f"bad signature for {method.upper()} {path} by {auth.public_key_hex[:16]}…"
        )
    return SignedBy(public_key_hex=auth.public_key_hex, timestamp=auth.timestamp, nonce=auth.nonce)


def verify_request(
    headers: Mapping[str, str],
    method: str,
    path: str,
    body: bytes,
    *,
    now: float,
    window_s: float = FRESHNESS_WINDOW_S,
) -> SignedBy:
    """Headers, freshness and signature of one request: the signer, or Refused.

    `path` is the path as sent, with its query string if any. The nonce is only checked for
    shape here; whether it was used before is the receiver's (`NonceCache`, or a database
    row written in the same transaction as the write it authorises)."""
    auth = parse_auth_headers(headers)
    check_fresh(auth, now=now, window_s=window_s)
    return check_signature(auth, method, path, body)


class NonceCache:
    """(wallet, nonce) pairs seen inside the freshness window; bounded, forgets what cannot come back.

    A pair is kept until its request's own timestamp + window: after that the freshness
    check alone refuses a replayed request, so forgetting is safe.
    """

    def __init__(self, window_s: float = FRESHNESS_WINDOW_S, max_entries: int = 100_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._expiry: dict[tuple[str, str], float] = {}
        self._heap: list[tuple[float, tuple[str, str]]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def _forget_expired(self, now: float) -> None:
        while self._heap and self._heap[0][0] < now:
            _, key = heapq.heappop(self._heap)
            self._expiry.pop(key, None)

    def add(self, wallet: str, nonce: str, timestamp: float, now: float) -> bool:
        """Record the pair; False if it was already seen (a replay). Refused("busy") when full."""
        self._forget_expired(now)
        key = (wallet, nonce)
        if key in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise Refused(BUSY, f"{len(self._expiry)} unexpired nonces held; retry later")
        expiry = timestamp + self.window_s
        self._expiry[key] = expiry
        heapq.heappush(self._heap, (expiry, key))
        return True
