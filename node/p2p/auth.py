"""The peer plane's HTTP side of signed requests: the aiohttp middleware, the client, and the status table.

The checks themselves are ``neuroshard.protocol.signing`` (headers, freshness, signature,
anti-replay nonces); this module reads them off aiohttp requests and turns every `Refused`
into an HTTP answer: a JSON `ErrorReply` (the refusal's code and detail) with the status
`STATUS` gives that code, and no change of state. The middleware runs before any handler:

- 404 / 405  unknown route or method (before anything else is read)
- 401        missing or malformed auth headers, a timestamp outside ±window, a bad signature
- 413        a body over the route's limit: Content-Length is checked before reading, and
             the body is read in chunks that stop at the limit (a lying or absent
             Content-Length cannot make the server buffer more)
- 400        a body that ends early (client gone mid-upload)
- 409        a nonce this wallet already used inside the window (a replay)
- 503        the nonce cache is full of unexpired nonces (refuse rather than forget one)

A nonce is recorded only after the signature verified, so forged requests cannot burn
other wallets' nonces. Handlers raise `Refused` for their own answers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict

from neuroshard.protocol import refusal
from neuroshard.protocol.peer import ErrorReply
from neuroshard.protocol.refusal import MAX_DETAIL_CHARS, Refused
from neuroshard.protocol.signing import (
    FRESHNESS_WINDOW_S,
    NonceCache,
    check_fresh,
    check_signature,
    parse_auth_headers,
    sign_request,
)

from ..wallet import Wallet

READ_CHUNK = 1 << 20
PEER_WALLET = web.RequestKey("neuroshard_peer_wallet", str)
"""Where the middleware stores the verified signer's public key hex on the request."""
BODY = web.RequestKey("neuroshard_body", bytes)
"""Where the middleware stores the verified body bytes on the request."""

Clock = Callable[[], float]
Unread = Callable[[str, str], Refused | None]
"""(route name, the wallet a request's headers claim) → a refusal to give before its body is read."""
BodyLimit = Callable[[str], int]
"""Route name -> the largest body in bytes that route accepts (0 for GET routes)."""

STATUS: Mapping[str, int] = {
    refusal.MALFORMED: 400,
    refusal.INVALID: 422,
    refusal.UNSIGNED: 401,
    refusal.BAD_AUTH: 401,
    refusal.STALE: 401,
    refusal.BAD_SIGNATURE: 401,
    refusal.REPLAYED: 409,
    refusal.BUSY: 503,
    refusal.TOO_LARGE: 413,
    "truncated": 400,
    "unknown_route": 404,
    "method_not_allowed": 405,
    # handlers' own refusals (server, objects, replay, pipeline)
    "not_ready": 503,
    "not_own": 422,
    "bad_record_signature": 422,
    "bad_name": 400,
    "not_published": 404,
    "bad_wait": 400,
    "bad_range": 400,
    "unsatisfiable_range": 416,
    "not_held": 404,
    "not_verifier": 403,
    "micro_batch_reused": 409,
    "bad_activation_signature": 422,
    "bad_end_signature": 422,
    "not_a_sender": 409,
    "payload_mismatch": 422,
    "wrong_stage": 422,
    "misdirected": 422,
    "another_run": 422,
    "wrong_shape": 422,
    "wrong_codec": 422,
    "non_finite": 422,
    "degenerate_activations": 422,
    "struck": 429,
    "not_a_member": 403,
    "downstream": 502,
    "step_failed": 500,
}
"""The peer plane's HTTP status for each refusal code; a code not listed answers 400."""


def status_of(code: str) -> int:
    return STATUS.get(code, 400)


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
    body = ErrorReply(error=code, detail=detail[:MAX_DETAIL_CHARS]).to_json()
    return web.Response(status=status, body=body, content_type="application/json")


def refusal_response(refused: Refused) -> web.Response:
    """The answer to a refusal: its code's status, its code and detail as an ErrorReply."""
    return error_response(status_of(refused.code), refused.code, refused.detail)


async def read_capped(request: web.Request, limit: int) -> bytes:
    """The whole body, refusing (413) before reading when Content-Length exceeds `limit` and
    while reading as soon as more than `limit` bytes arrived."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise Refused(refusal.TOO_LARGE, f"body of {declared} bytes exceeds this route's limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        while chunk := await request.content.read(READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise Refused(refusal.TOO_LARGE, f"body exceeds this route's limit of {limit} bytes")
            chunks.append(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.http_exceptions.HttpProcessingError, ConnectionError) as exc:
        raise Refused("truncated", f"body ended early: {exc}") from None
    if declared is not None and size != declared:
        raise Refused("truncated", f"body has {size} bytes, Content-Length said {declared}")
    return b"".join(chunks)  # one copy; growing a bytearray copies a 30 MB body several times


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middleware(
    *,
    nonces: NonceCache,
    body_limit: BodyLimit,
    clock: Clock,
    window_s: float = FRESHNESS_WINDOW_S,
    traffic: Traffic | None = None,
    unread: Unread | None = None,
) -> Middleware:
    """aiohttp middleware: route check, auth headers, window, size, signature, nonce — then the handler.

    `unread` may refuse a request on the wallet its headers claim, before its body is read or its
    signature checked: refusing a claim costs its true owner nothing it was not refused anyway, and
    a sender the route would refuse after reading (a pipeline micro-batch from a wallet that is not
    on the list) no longer costs the receiver the body's bytes. Any refusal given before the body
    was read (that one, stale headers, a declared size over the limit) is sent and the connection
    closed at once: aiohttp would otherwise read and drop the rest of the body, for up to 10 s, to
    keep the connection open. The sending aiohttp client reads the refusal and stops."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await checked(request, handler)
        if traffic is not None:
            traffic.requests += 1
            traffic.bytes_received += head_bytes(
                f"{request.method} {request.raw_path} HTTP/1.1", request.raw_headers
            )
            # What came in of the body, read or not: a body refused unread is cut off (`_closing`),
            # and its declared length was never received.
            traffic.bytes_received += request.content.total_bytes
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
            return refusal_response(Refused(code, f"no route {request.method} {request.path}"))
        body_read = False
        try:
            auth = parse_auth_headers(request.headers)
            now = clock()
            check_fresh(auth, now=now, window_s=window_s)
            route = request.match_info.route.name or ""
            early = None if unread is None else unread(route, auth.public_key_hex)
            if early is not None:
                raise early
            body = await read_capped(request, body_limit(route))
            body_read = True
            signed = check_signature(auth, request.method, request.raw_path, body)
            if not nonces.add(signed.public_key_hex, signed.nonce, signed.timestamp, now):
                raise Refused(refusal.REPLAYED, f"nonce {signed.nonce} was already used by this wallet")
            request[PEER_WALLET] = signed.public_key_hex
            request[BODY] = body
            return await handler(request)
        except Refused as exc:
            response = refusal_response(exc)
            if body_read or exc.code == "truncated" or not request.body_exists or request.content.is_eof():
                return response  # read, none, or all in; a truncated body's sender is gone already
            return await _closing(request, response)

    return middleware


async def _closing(request: web.Request, response: web.Response) -> web.Response:
    """Send `response` and close the connection, leaving the request's body unread (a sender gone
    meanwhile is not an error of this server's)."""
    response.force_close()
    try:
        await response.prepare(request)
        await response.write_eof()
    except (ConnectionError, aiohttp.ClientConnectionError):
        pass
    finally:
        request.protocol.force_close()
    return response


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
        except Refused:
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
                    data = await read_reply(resp, max_bytes)
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


async def read_reply(resp: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    """A reply's body, read in chunks that stop at `max_bytes` (8 KiB at least, for error replies);
    PeerUnreachable beyond it."""
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
