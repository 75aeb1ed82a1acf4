"""Signed POSTs to a replica behind NAT, carried by the stage bucket: the pipeline of relay replicas.

A relay replica (``--relay`` and no ``--port``, relay.py) accepts no connections, yet a pipeline
stage > 0 must take micro-batches from the stage before it. So the request travels as an object:

| step | who      | what                                                                         |
|------|----------|------------------------------------------------------------------------------|
| 1    | sender   | PUT ``_pipe/{receiver}/{sender}/{token}``: the signed request (headers, body) |
| 2    | receiver | LIST ``_pipe/{itself}/`` (one request a pass, however many send to it), GET it |
| 3    | receiver | hand it to its own peer server on a loopback port, as it arrived             |
| 4    | receiver | PUT ``{receiver}/pipe/{sender}/{token}``: the status, headers and body answered |
| 5    | sender   | GET that key until it appears (tens of ms apart), then DELETE its request    |
| 6    | receiver | DELETE its answer once the request is gone                                   |

The receiver's server is the one a replica with a port runs (``server.build_app``), bound to
127.0.0.1 only: every check a request meets over HTTP — signature, freshness, nonce, body limit,
the pipeline's own checks, its once-per-micro-batch rule — it meets here, unchanged, and so does a
reply (the gradient's signed header). The bucket is a carrier, not an authority: a request whose
signer is not the wallet its key names is answered with a refusal and never reaches the server,
and anything else someone with write access to ``_pipe/`` could put there fails the server's
checks like a forged HTTP request. Only the routes a server extension names for it pass
(`Mailboxed`: the pipeline's forward and end); the peer plane's GET routes already have their
bucket objects (relay.py).

Write access. A wallet writes its requests under ``_pipe/*/{wallet}/*`` (an IAM resource pattern
can say exactly that) and its answers under its own prefix, as it does its round objects.

Cost. The receiver LISTs every `MailboxTimings.min_poll_s` while requests come and backs off to
`max_poll_s` when none do (S3: ~$0.005 per 1,000 LISTs, so ~$0.43 a day for an idle replica at
1 s); a micro-batch costs its sender one PUT, a few GETs and a DELETE, and its receiver one GET,
one PUT and one DELETE. Latency: a round trip adds two object writes and the polls to the step's
compute (tens of milliseconds on a nearby bucket), which the pipeline's throughput-weighted
router (pipeline.py) weighs like any other slowness.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import secrets
import struct
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp
from multidict import CIMultiDict

from neuroshard.protocol.peer import ErrorReply
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.signing import WALLET_HEADER, sign_request

from ..outer.port import check_wallet
from ..wallet import Wallet
from .auth import Clock, PeerReply, PeerUnreachable, Traffic, read_reply, status_of
from .bucket import BucketStore, RelayError

REQUEST_PREFIX = "_pipe"
"""Where senders put their requests (``_pipe/{receiver}/{sender}/{token}``)."""
REPLY_DIR = "pipe"
"""Where a receiver puts its answers, under its own prefix (``{receiver}/pipe/{sender}/{token}``)."""
TOKEN = re.compile(r"^[0-9a-f]{32}$")
WALLET = re.compile(r"^[0-9a-f]{64}$")
HEAD = struct.Struct(">I")
"""A request or reply object: 4-byte length of its JSON head, the head, then the body."""
MAX_HEAD_BYTES = 64 << 10
PASSED_HEADERS = re.compile(r"^(x-neuroshard-[a-z0-9-]+|content-type)$", re.IGNORECASE)
"""The headers a request or reply carries through the bucket: ours and the body's type, no others."""
MAX_LISTED = 1000


@dataclass(frozen=True)
class MailboxRoutes:
    """What a server extension takes through the bucket."""

    routes: Mapping[str, int]
    """POST path → the largest request body it takes."""
    reply_bytes: int
    """The largest body it answers."""
    timeout_s: float
    """How long its server may take to answer one request."""


@runtime_checkable
class Mailboxed(Protocol):
    """A server extension whose POST routes a relay replica takes through its bucket."""

    def mailbox(self) -> MailboxRoutes: ...


@dataclass(frozen=True)
class MailboxTimings:
    """Seconds."""

    min_poll_s: float = 0.05
    """Between a receiver's LISTs while requests come, and between a sender's reads of its answer."""
    max_poll_s: float = 1.0
    """The receiver's LIST interval when idle (after `active_s` without a request, each empty pass
    waits ×1.5 longer, up to this)."""
    active_s: float = 5.0
    """How long after its last request a receiver keeps polling at `min_poll_s`: a driver sends its
    next micro-batch a step after the last, and a backed-off poll would add its wait to every step."""
    reply_poll_max_s: float = 0.1
    """Largest wait between a sender's reads of its answer."""
    in_flight: int = 8
    """Requests a receiver hands its server at once; the rest wait for a later pass."""
    per_sender: int = 8
    """Requests one sender may have waiting here, not yet taken; beyond it the rest are deleted."""
    linger_s: float = 300.0
    """An answered request still there this long after its answer (its sender gone) is deleted
    with the answer: no sender waits that long (its signature's freshness is ±60 s)."""


def request_path(receiver: str, sender: str, token: str) -> str:
    return f"{REQUEST_PREFIX}/{check_wallet(receiver)}/{check_wallet(sender)}/{token}"


def reply_name(sender: str, token: str) -> str:
    """The answer's object name under the receiver's prefix."""
    return f"{REPLY_DIR}/{check_wallet(sender)}/{token}"


def _pack(head: dict[str, object], body: bytes) -> bytes:
    raw = json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    return HEAD.pack(len(raw)) + raw + body


def _unpack(data: bytes) -> tuple[dict[str, object], bytes]:
    if len(data) < HEAD.size:
        raise malformed("mailbox object shorter than its head")
    (length,) = HEAD.unpack_from(data)
    end = HEAD.size + length
    if length > MAX_HEAD_BYTES or end > len(data):
        raise malformed(f"mailbox object head of {length} bytes does not fit")
    try:
        head = json.loads(data[HEAD.size : end])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise malformed(f"mailbox object head is not JSON: {exc}") from None
    if not isinstance(head, dict):
        raise malformed("mailbox object head is not a JSON object")
    return head, data[end:]


def _headers(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise malformed("mailbox headers are not a JSON object of strings")
    return {k: v for k, v in value.items() if PASSED_HEADERS.match(k)}


def encode_request(path: str, headers: Mapping[str, str], body: bytes) -> bytes:
    return _pack({"method": "POST", "path": path, "headers": dict(headers)}, body)


def decode_request(data: bytes) -> tuple[str, dict[str, str], bytes]:
    """(path, passed headers, body) of a request object; Refused if it is not one."""
    head, body = _unpack(data)
    if head.get("method") != "POST" or not isinstance(head.get("path"), str):
        raise malformed("a mailbox request is a POST with a path")
    return str(head["path"]), _headers(head.get("headers")), body


def encode_reply(status: int, headers: Mapping[str, str], body: bytes) -> bytes:
    return _pack({"status": status, "headers": dict(headers)}, body)


def decode_reply(data: bytes) -> PeerReply:
    head, body = _unpack(data)
    status = head.get("status")
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        raise malformed("a mailbox reply names an HTTP status")
    return PeerReply(status, CIMultiDict(_headers(head.get("headers"))), body)


def _refusal(status: int, code: str, detail: str) -> bytes:
    return encode_reply(
        status, {"Content-Type": "application/json"}, ErrorReply(error=code, detail=detail).to_json()
    )


class Cleanup:
    """A sender's request deletions, run off its path (the answer is what it waits for) and
    awaited when it closes, so none is cut off with its event loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # a failure costs storage only (the bucket's lifecycle rule, bucket.py)

    async def wait(self, timeout_s: float = 10.0) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def post(
    store: BucketStore,
    wallet: Wallet,
    clock: Clock,
    to: str,
    path: str,
    *,
    body: bytes,
    headers: Mapping[str, str],
    max_bytes: int,
    timeout_s: float,
    timings: MailboxTimings = MailboxTimings(),
    traffic: Traffic | None = None,
    cleanup: Cleanup | None = None,
) -> PeerReply:
    """POST `body` to relay replica `to` through the bucket (steps 1 and 5 above) and return its
    answer; PeerUnreachable when the bucket refuses the request or no answer comes in `timeout_s`.
    The request is deleted after: on `cleanup`'s time when given, before returning otherwise."""
    token = secrets.token_hex(16)
    signed = {**headers, **sign_request(wallet, "POST", path, body, clock())}
    request = encode_request(path, signed, body)
    where = request_path(to, wallet.public_key_hex, token)
    try:
        await store.put_shared(where, request)
    except RelayError as exc:
        raise PeerUnreachable(f"POST {path} to {to[:12]} through the bucket: {exc}") from None
    try:
        raw = await store.fetch(
            to,
            reply_name(wallet.public_key_hex, token),
            max_bytes=max(max_bytes, 8192) + MAX_HEAD_BYTES + HEAD.size,
            wait_s=timeout_s,
            poll_s=(timings.min_poll_s, timings.reply_poll_max_s),
        )
    finally:
        if cleanup is not None:
            cleanup.start(store.delete_shared(where))
        else:
            await store.delete_shared(where)
    if traffic is not None:
        traffic.requests += 1
        traffic.bytes_sent += len(request)
        traffic.bytes_received += len(raw or b"")
    if raw is None:
        raise PeerUnreachable(f"POST {path} to {to[:12]}: no answer in the bucket within {timeout_s:.0f} s")
    try:
        return decode_reply(raw)
    except Refused as exc:
        raise PeerUnreachable(f"POST {path} to {to[:12]}: unreadable answer: {exc.detail}") from None


class MailboxServer:
    """A relay replica's side (steps 2, 3, 4 and 6): requests from the bucket to its loopback server."""

    def __init__(
        self,
        store: BucketStore,
        *,
        local: str,
        routes: MailboxRoutes,
        log: Callable[[str], None],
        timings: MailboxTimings = MailboxTimings(),
    ) -> None:
        self.store = store
        self.local = local
        """host:port of this replica's own server, on the loopback interface."""
        self.routes = dict(routes.routes)
        self.reply_bytes = routes.reply_bytes
        self.request_timeout_s = routes.timeout_s
        self.log = log
        self.timings = timings
        self.served = 0
        self._answered: dict[str, float] = {}
        """Requests (``{sender}/{token}``) answered whose object is still there (the answer is kept
        until then, or until `MailboxTimings.linger_s` after it was written), and when."""
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._max_request = max(self.routes.values(), default=0) + MAX_HEAD_BYTES + HEAD.size

    @property
    def own(self) -> str:
        return self.store.wallet

    async def run(self) -> None:
        """Serve until cancelled."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        loop = asyncio.get_running_loop()
        interval, active_until = self.timings.min_poll_s, 0.0
        try:
            while True:
                try:
                    new = await self.pass_once()
                except RelayError as exc:
                    self.log(f"bucket: cannot read pipeline requests: {exc}")
                    new = 0
                if new or self._busy:
                    active_until = loop.time() + self.timings.active_s
                if loop.time() < active_until:
                    interval = self.timings.min_poll_s
                else:
                    interval = min(interval * 1.5, self.timings.max_poll_s)
                await asyncio.sleep(interval)
        finally:
            for task in self._busy.values():
                task.cancel()
            await asyncio.gather(*self._busy.values(), return_exceptions=True)
            await self._session.close()

    async def pass_once(self) -> int:
        """One LIST: start serving new requests, delete the answers whose request is gone, and clear
        what would otherwise fill the listing; returns how many requests were started."""
        listed, _ = await self.store.list_under(f"{REQUEST_PREFIX}/{self.own}/", max_keys=MAX_LISTED)
        waiting = set(listed)
        now = asyncio.get_running_loop().time()
        gone = [key for key in self._answered if key not in waiting]
        stale = [
            key for key, at in self._answered.items() if key in waiting and now - at > self.timings.linger_s
        ]
        flood = self._flooding(waiting)
        for key in sorted(gone + stale):  # the sender has read its answer, gave up, or left
            del self._answered[key]
            sender, _, token = key.partition("/")
            await self.store.delete(reply_name(sender, token))
        if stale or flood:  # requests nobody waits for any more, or beyond a sender's share
            await self.store.delete_shared_many(
                [f"{REQUEST_PREFIX}/{self.own}/{key}" for key in stale + flood]
            )
            waiting.difference_update(flood)
        started = 0
        for key in sorted(waiting - self._answered.keys() - self._busy.keys()):
            if len(self._busy) >= self.timings.in_flight:
                break
            sender, _, token = key.partition("/")
            if not WALLET.match(sender) or not TOKEN.match(token):
                continue  # not a request's name: nothing to answer it under
            task = asyncio.create_task(self._serve(sender, token))
            self._busy[key] = task
            task.add_done_callback(functools.partial(self._done, key))
            started += 1
        return started

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        self._busy.pop(key, None)

    def _flooding(self, waiting: set[str]) -> list[str]:
        """Requests beyond `MailboxTimings.per_sender` waiting from one sender and not yet taken: a
        driver has one micro-batch in flight at a time (a few with retries), so a sender with more is
        filling this replica's one LIST page to crowd the others out of it. Its first names in
        order are kept (a token says nothing of age: which ones is arbitrary, but fixed)."""
        by_sender: dict[str, list[str]] = {}
        for key in waiting - self._answered.keys() - self._busy.keys():
            by_sender.setdefault(key.partition("/")[0], []).append(key)
        flood: list[str] = []
        for sender, keys in sorted(by_sender.items()):
            if len(keys) > self.timings.per_sender:
                flood.extend(sorted(keys)[self.timings.per_sender :])
                self.log(
                    f"bucket: {sender[:12]} has {len(keys)} pipeline requests waiting here; "
                    f"all but {self.timings.per_sender} deleted unanswered"
                )
        return flood

    async def _serve(self, sender: str, token: str) -> None:
        try:
            reply = await self._answer(sender, token)
        except Refused as exc:
            reply = _refusal(status_of(exc.code), exc.code, exc.detail)
        try:
            await self.store.publish(reply_name(sender, token), reply)
        except RelayError as exc:
            self.log(f"bucket: cannot answer a pipeline request of {sender[:12]}: {exc}")
            return  # not answered: the next pass tries again if the request is still there
        self._answered[f"{sender}/{token}"] = asyncio.get_running_loop().time()
        self.served += 1

    async def _answer(self, sender: str, token: str) -> bytes:
        raw = await self.store.get_shared(request_path(self.own, sender, token), self._max_request)
        if raw is None:
            raise malformed("the request object is gone, too large or unreadable")
        path, headers, body = decode_request(raw)
        limit = self.routes.get(path)
        if limit is None:
            return _refusal(404, "unknown_route", f"no route POST {path[:60]} through the bucket")
        if len(body) > limit:
            return _refusal(413, "too_large", f"a body of {len(body)} bytes; POST {path} takes {limit}")
        signer = next((v for k, v in headers.items() if k.lower() == WALLET_HEADER.lower()), None)
        if signer != sender:
            return _refusal(
                400, "not_own", "a request in the bucket must be signed by the wallet its name says sent it"
            )
        assert self._session is not None
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with self._session.post(
                    f"http://{self.local}{path}", data=body, headers=headers
                ) as resp:
                    data = await read_reply(resp, self.reply_bytes)
                    passed = {k: v for k, v in resp.headers.items() if PASSED_HEADERS.match(k)}
                    return encode_reply(resp.status, passed, data)
        except PeerUnreachable as exc:
            return _refusal(500, "step_failed", f"this replica's answer is unfit to send: {exc}")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _refusal(503, "busy", f"this replica's server did not answer: {type(exc).__name__}")
