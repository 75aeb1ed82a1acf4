"""Signed requests: the client signs every request, the server middleware checks every request.

The middleware runs before any handler and answers, with a JSON `ErrorReply` and no
change of state:

- 404 / 405  unknown route or method (before anything else is read)
- 401        missing or malformed auth headers, a timestamp outside ±window, a bad signature
- 413        a body over the route's limit: Content-Length is checked before reading, and
             the body is read in chunks that stop at the limit (a lying or absent
             Content-Length cannot make the server buffer more)
- 400        a body that ends early (client gone mid-upload)
- 409        a nonce this wallet already used inside the window (a replay)
- 503        the nonce cache is full of unexpired nonces (refuse rather than forget one)

A nonce is recorded only after the signature verified, so forged requests cannot burn
other wallets' nonces. Handlers raise `Rejected` (or a `wire.WireError`) for their own
4xx answers; the middleware turns both into the same JSON shape.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict

from ..wallet import Wallet, verify
from .wire import (
    NONCE_BYTES,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
    ErrorReply,
    Rejected,
    WireError,
    request_signing_bytes,
)

REPLAY_WINDOW_S = 60.0
"""Requests whose timestamp is further than this from the receiver's clock are stale (issue 4)."""
READ_CHUNK = 1 << 20
PEER_WALLET = web.RequestKey("neuroshard_peer_wallet", str)
"""Where the middleware stores the verified signer's public key hex on the request."""
BODY = web.RequestKey("neuroshard_body", bytes)
"""Where the middleware stores the verified body bytes on the request."""

Clock = Callable[[], float]
BodyLimit = Callable[[str], int]
"""Route name -> the largest body in bytes that route accepts (0 for GET routes)."""


@dataclass
class Traffic:
    """Bytes at the HTTP layer — bodies plus request/status lines and headers; TCP/IP framing
    and TLS are not counted. The client counts its requests and their replies, the server the
    requests it received and the replies it sent."""

    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0


def head_bytes(start_line: str, headers: Iterable[tuple[Any, Any]]) -> int:
    """Size of an HTTP/1.1 head: start line, `name: value` lines, CRLFs."""
    return len(start_line) + 2 + sum(len(k) + len(v) + 4 for k, v in headers) + 2


def error_response(status: int, code: str, detail: str) -> web.Response:
    body = ErrorReply(error=code, detail=detail[:2000]).to_json()
    return web.Response(status=status, body=body, content_type="application/json")


class NonceCache:
    """(wallet, nonce) pairs seen inside the replay window; bounded, forgets what cannot replay.

    A pair is kept until its request's own timestamp + window: after that the timestamp
    check alone rejects a replay, so forgetting is safe.
    """

    def __init__(self, window_s: float = REPLAY_WINDOW_S, max_entries: int = 100_000) -> None:
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
        """Record the pair; False if it was already seen (a replay). Raises Rejected(503) when full."""
        self._forget_expired(now)
        key = (wallet, nonce)
        if key in self._expiry:
            return False
        if len(self._expiry) >= self.max_entries:
            raise Rejected(503, "busy", f"{len(self._expiry)} unexpired nonces held; retry later")
        expiry = timestamp + self.window_s
        self._expiry[key] = expiry
        heapq.heappush(self._heap, (expiry, key))
        return True


def sign_request(wallet: Wallet, method: str, path: str, body: bytes, now: float) -> dict[str, str]:
    """The four auth headers for one request."""
    timestamp = str(int(now * 1000))
    nonce = secrets.token_hex(NONCE_BYTES)
    message = request_signing_bytes(method, path, hashlib.sha256(body).hexdigest(), timestamp, nonce)
    return {
        WALLET_HEADER: wallet.public_key_hex,
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: wallet.sign(message).hex(),
    }


@dataclass(frozen=True)
class _AuthHeaders:
    wallet: str
    timestamp_ms: str
    nonce: str
    signature: bytes

    @property
    def timestamp(self) -> float:
        return int(self.timestamp_ms) / 1000.0


def _is_hex(value: str, chars: int) -> bool:
    return len(value) == chars and all(c in "0123456789abcdef" for c in value)


def _parse_auth_headers(headers: Mapping[str, str]) -> _AuthHeaders:
    missing = [
        h for h in (WALLET_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER) if h not in headers
    ]
    if missing:
        raise Rejected(401, "unsigned", f"missing auth header(s) {', '.join(missing)}")
    wallet, timestamp, nonce, signature = (
        headers[WALLET_HEADER],
        headers[TIMESTAMP_HEADER],
        headers[NONCE_HEADER],
        headers[SIGNATURE_HEADER],
    )
    if not _is_hex(wallet, 64):
        raise Rejected(401, "bad_auth", f"{WALLET_HEADER} must be 64 lowercase hex characters")
    if not (timestamp.isdigit() and len(timestamp) <= 16):
        raise Rejected(401, "bad_auth", f"{TIMESTAMP_HEADER} must be Unix time in integer milliseconds")
    if not _is_hex(nonce, 2 * NONCE_BYTES):
        raise Rejected(401, "bad_auth", f"{NONCE_HEADER} must be {2 * NONCE_BYTES} lowercase hex characters")
    if not _is_hex(signature, 128):
        raise Rejected(401, "bad_auth", f"{SIGNATURE_HEADER} must be 128 lowercase hex characters")
    return _AuthHeaders(wallet, timestamp, nonce, bytes.fromhex(signature))


async def read_capped(request: web.Request, limit: int) -> bytes:
    """The whole body, refusing (413) before reading when Content-Length exceeds `limit` and
    while reading as soon as more than `limit` bytes arrived."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Rejected(413, "too_large", f"body of {declared} bytes exceeds this route's limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.read(READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise Rejected(413, "too_large", f"body exceeds this route's limit of {limit} bytes")
            chunks.append(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError, ConnectionError) as exc:
        raise Rejected(400, "truncated", f"body ended early: {exc}") from None
    if declared is not None and size != declared:
        raise Rejected(400, "truncated", f"body has {size} bytes, Content-Length said {declared}")
    return b"".join(chunks)  # one copy; growing a bytearray copies a 30 MB body several times


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(
    *,
    nonces: NonceCache,
    body_limit: BodyLimit,
    clock: Clock,
    window_s: float = REPLAY_WINDOW_S,
    traffic: Traffic | None = None,
) -> Middleware:
    """aiohttp middleware: route check, auth headers, window, size, signature, nonce — then the handler."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await checked(request, handler)
        if traffic is not None:
            traffic.requests += 1
            traffic.bytes_received += head_bytes(
                f"{request.method} {request.raw_path} HTTP/1.1", request.raw_headers
            )
            traffic.bytes_received += request.content_length or 0
            # Date, Server and Content-Length are added after this point: ~80 bytes not counted.
            traffic.bytes_sent += head_bytes(
                f"HTTP/1.1 {response.status} {response.reason}", response.headers.items()
            )
            traffic.bytes_sent += response.content_length or 0
        return response

    async def checked(request: web.Request, handler: Handler) -> web.StreamResponse:
        unmatched = request.match_info.http_exception
        if unmatched is not None:
            code = "unknown_route" if unmatched.status == 404 else "method_not_allowed"
            return error_response(unmatched.status, code, f"no route {request.method} {request.path}")
        try:
            auth = _parse_auth_headers(request.headers)
            now = clock()
            if abs(now - auth.timestamp) > window_s:
                raise Rejected(
                    401,
                    "stale",
                    f"timestamp {auth.timestamp:.3f} is {now - auth.timestamp:+.1f} s from this node's clock "
                    f"(allowed ±{window_s:.0f} s)",
                )
            route = request.match_info.route.name or ""
            body = await read_capped(request, body_limit(route))
            message = request_signing_bytes(
                request.method,
                request.raw_path,
                hashlib.sha256(body).hexdigest(),
                auth.timestamp_ms,
                auth.nonce,
            )
            if not verify(bytes.fromhex(auth.wallet), message, auth.signature):
                raise Rejected(
                    401, "bad_signature", f"request signature does not verify for wallet {auth.wallet[:16]}…"
                )
            if not nonces.add(auth.wallet, auth.nonce, auth.timestamp, now):
                raise Rejected(409, "replay", f"nonce {auth.nonce} was already used by this wallet")
            request[PEER_WALLET] = auth.wallet
            request[BODY] = body
            return await handler(request)
        except Rejected as exc:
            return error_response(exc.status, exc.code, exc.detail)
        except WireError as exc:
            return error_response(exc.status, exc.code, str(exc))

    return middleware


class PeerUnreachable(Exception):
    """A peer did not answer usefully: connection refused or reset, timeout, or an oversized reply."""


@dataclass(frozen=True)
class PeerReply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    @property
    def ok(self) -> bool:
        return self.status == 200

    def error(self) -> str:
        """The peer's ErrorReply detail, or a prefix of the body if it is not one."""
        try:
            return ErrorReply.from_json(self.body).detail
        except WireError:
            return self.body[:200].decode("utf-8", "replace")


class PeerClient:
    """Signed HTTP requests to peers over one aiohttp session; every reply read under a size cap."""

    def __init__(
        self, wallet: Wallet, *, clock: Clock = time.time, connect_timeout_s: float, request_timeout_s: float
    ) -> None:
        self._wallet = wallet
        self._clock = clock
        self._connect_timeout_s = connect_timeout_s
        self._request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.traffic = Traffic()

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        address: str,
        path: str,
        *,
        max_bytes: int,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> PeerReply:
        """Send a signed request to `address` (host:port); raise PeerUnreachable on transport failure."""
        if self._session is None:
            raise RuntimeError("PeerClient.start() was not called")
        signed = {**(headers or {}), **sign_request(self._wallet, method, path, body, self._clock())}
        url = f"http://{address}{path}"
        try:
            async with asyncio.timeout(timeout_s or self._request_timeout_s):
                async with self._session.request(method, url, data=body or None, headers=signed) as resp:
                    data = await _read_reply(resp, max_bytes)
                    self.traffic.requests += 1
                    self.traffic.bytes_sent += len(body) + head_bytes(
                        f"{method} {path} HTTP/1.1", resp.request_info.headers.items()
                    )
                    self.traffic.bytes_received += len(data) + head_bytes(
                        f"HTTP/1.1 {resp.status} {resp.reason}", resp.raw_headers
                    )
                    return PeerReply(resp.status, CIMultiDict(resp.headers), data)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise PeerUnreachable(f"{method} {address}{path}: {type(exc).__name__}: {exc}") from None


async def _read_reply(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    # Error replies are small JSON; allow them even where a route's success body is empty.
    limit = max(max_bytes, 8192)
    if resp.content_length is not None and resp.content_length > limit:
        raise PeerUnreachable(f"reply of {resp.content_length} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    while chunk := await resp.content.read(READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise PeerUnreachable(f"reply exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
