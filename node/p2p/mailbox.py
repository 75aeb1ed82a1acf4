"""Signed POSTs to a replica behind NAT, carried by the stage bucket: the pipeline of relay replicas.

A relay replica (``--relay`` and no ``--port``, relay.py) accepts no connections, yet a pipeline
stage > 0 must take micro-batches from the stage before it. So the request travels as an object:

| step | who      | what                                                                         |
|------|----------|------------------------------------------------------------------------------|
| 1    | sender   | PUT ``_pipe/{receiver}/{sender}/{token}``: the signed request (headers, body) |
| 2    | receiver | LIST ``_pipe/{itself}/`` (one LIST a pass, however many send to it), GET it   |
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

Write access. A wallet writes its requests under ``_pipe/*/{wallet}/*``, its answers under its own
prefix (as it does its round objects), and deletes in its inbox ``_pipe/{wallet}/*``. An IAM ``*``
also matches ``/``, so that pattern lets a wallet write names like ``_pipe/{r}/{other}/{wallet}/x``
as well: the receiver reads only names that are exactly ``{sender}/{token}`` (which only the sender
can write) and deletes every other name unread.

What is written to an inbox cannot fill it for good or starve a sender (`MailboxServer`): a receiver
reads one LIST page (1,000 names) a pass, the next page on the next pass when one is full; it
deletes malformed names (one by one where DeleteObjects' XML cannot carry them), a sender's names
beyond `MailboxTimings.per_sender` (answered ones first) and answered requests left `linger_s`
after their answer, and takes new requests one per sender in turn, the least recently served
first — a sender never served here as if served now, so that a crowd of fresh wallets does not go
ahead of the senders taking turns, and a sender lately refused (forged, malformed: `REFUSED_STATUSES`)
after everyone. Not bounded: many wallets each at its share slow every sender down (a page a pass,
and a turn each once they have had one); and
every bucket reader can read the micro-batches in it (a request names its receiver, signed, so
none can be replayed to another).

Cost. While requests come, the receiver LISTs every tenth of the mean time between them (50 ms at
least, `poll_interval`), and backs off to once a second when none do. At S3's $0.005 per 1,000
LISTs that is ~$8.6 a day at the 50 ms floor (a tiny model's 0.2 s steps), ~$2.2 for a model
that takes 2 s a micro-batch, ~$0.43 idle; R2 charges about the same for LISTs. A micro-batch costs its sender one PUT, a few GETs and a DELETE, and its receiver one GET,
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
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp
from multidict import CIMultiDict

from neuroshard.protocol.peer import ErrorReply
from neuroshard.protocol.refusal import Refused, malformed
from neuroshard.protocol.schema import parse_json
from neuroshard.protocol.signing import WALLET_HEADER, sign_request

from ..outer.port import check_wallet
from ..wallet import Wallet
from .auth import Clock, PeerReply, PeerUnreachable, Traffic, read_reply, status_of
from .bucket import BucketStore, RelayError

REQUEST_PREFIX = "_pipe"
"""Where senders put their requests (``_pipe/{receiver}/{sender}/{token}``)."""
REPLY_DIR = "pipe"
"""Where a receiver puts its answers, under its own prefix (``{receiver}/pipe/{sender}/{token}``)."""
REQUEST_KEY = re.compile(r"[0-9a-f]{64}/[0-9a-f]{32}")
"""A request's name under the receiver's inbox: ``{sender}/{token}``. Nothing else is read there."""
HEAD = struct.Struct(">I")
"""A request or reply object: 4-byte length of its JSON head, the head, then the body."""
MAX_HEAD_BYTES = 64 << 10
PASSED_HEADERS = re.compile(r"x-neuroshard-[a-z0-9-]+|content-type", re.IGNORECASE)
"""The headers a request or reply carries through the bucket (whole names): ours and the body's
type, no others."""
HEADER_VALUE = re.compile(r"[\x20-\x7e]{0,16384}")
"""A header value: printable ASCII (no line breaks to inject headers with), 16 KiB at most."""
MAX_LISTED = 1000
MAX_REMEMBERED_SENDERS = 4096
"""Senders whose last turn a receiver remembers (the half served longest ago is forgotten beyond it)."""
REFUSED_STATUSES = frozenset({400, 401, 403, 404, 413, 422, 429})
"""Answers that say a request was not one to take (forged, malformed, another route or run, a
struck sender's): a sender given one waits behind every other sender for `REFUSED_PASSES`
passes. Not 409 (an id reused: a retry does that) and not 5xx (this replica's trouble)."""
REFUSED_PASSES = 100
READ_TRIES = 3
"""Passes on which a receiver tries to read a request the bucket failed to hand over (a `transient`
error, bucket.py) before it answers 503 (busy), so that its sender tries another replica at once."""


@dataclass(frozen=True)
class MailboxRoutes:
    """What a server extension takes through the bucket."""

    routes: Mapping[str, int]
    """POST path → the largest request body it takes."""
    reply_bytes: int
    """The largest body it answers."""
    timeout_s: float
    """How long its server may take to answer one request."""
    refuses: Callable[[str], str | None] | None = None
    """Why its routes take nothing from a sender (a wallet off the stage's member list), or None:
    such a sender's requests are answered 403 ``not_a_member`` without being read from the bucket.
    None: every sender's are read."""

    @staticmethod
    def merged(boxes: Sequence[MailboxRoutes]) -> MailboxRoutes:
        """What a replica's extensions take through the bucket together. A request is left unread
        only when every extension refuses its sender (each asked until one takes it)."""
        refusers = [box.refuses for box in boxes if box.refuses is not None]

        def refuses(sender: str) -> str | None:
            why = None
            for refuser in refusers:
                why = refuser(sender)
                if why is None:
                    return None
            return why

        return MailboxRoutes(
            routes={path: limit for box in boxes for path, limit in box.routes.items()},
            reply_bytes=max(box.reply_bytes for box in boxes),
            timeout_s=max(box.timeout_s for box in boxes),
            refuses=refuses if refusers and len(refusers) == len(boxes) else None,
        )


@runtime_checkable
class Mailboxed(Protocol):
    """A server extension whose POST routes a relay replica takes through its bucket."""

    def mailbox(self) -> MailboxRoutes: ...


@dataclass(frozen=True)
class MailboxTimings:
    """Seconds."""

    min_poll_s: float = 0.05
    """The shortest wait between a receiver's LISTs, and between a sender's reads of its answer."""
    max_poll_s: float = 1.0
    """The receiver's LIST interval when idle (after `active_s` without a request, each empty pass
    waits ×1.5 longer, up to this)."""
    poll_share: float = 0.1
    """While requests come, a receiver LISTs every `poll_share` × the mean time between them (within
    [min_poll_s, max_poll_s]): the wait adds about half that share to a micro-batch's round trip,
    and the LIST bill follows the request rate (`poll_interval`)."""
    active_s: float = 5.0
    """How long after its last request (or 3 × the mean time between them, if longer) a receiver
    keeps polling at that rate: a driver sends its next micro-batch a step after the last, and a
    backed-off poll would add its wait to every step."""
    reply_poll_max_s: float = 0.1
    """Largest wait between a sender's reads of its answer."""
    in_flight: int = 8
    """Requests a receiver hands its server at once; the rest wait for a later pass."""
    per_sender: int = 8
    """Requests one sender may have here, waiting, taken or answered: a driver has one in flight, a
    middle stage's replica one for each micro-batch it computes (`PipelineConfig.max_pending` + 1),
    a retry leaves one more behind. A sender with more is filling the inbox's one LIST page to crowd
    the others out; the excess is deleted, answered ones first."""
    linger_s: float = 120.0
    """An answered request still there this long after its answer (its sender gone) is deleted
    with the answer: a sender waits 1.5 × the pipeline's request timeout (90 s by default)."""


def poll_interval(gap_s: float | None, timings: MailboxTimings) -> float:
    """A busy receiver's wait between LISTs, given the mean time between its requests (None: not
    known yet). At S3's $0.005 per 1,000 LISTs, 20 a second cost ~$8.6 a day and 5 ~$2.2: a
    model that takes 2 s a micro-batch pays the second, for ~5% more time per micro-batch."""
    if gap_s is None:
        return timings.min_poll_s
    return min(max(timings.poll_share * gap_s, timings.min_poll_s), timings.max_poll_s)


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
    head = parse_json(data[HEAD.size : end], "a mailbox object's head")
    if not isinstance(head, dict):
        raise malformed("mailbox object head is not a JSON object")
    return head, data[end:]


def _headers(value: object) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise malformed("mailbox headers are not a JSON object of strings")
    passed = {k: v for k, v in value.items() if PASSED_HEADERS.fullmatch(k)}
    if not all(HEADER_VALUE.fullmatch(v) for v in passed.values()):
        raise malformed("a mailbox header value is not printable ASCII of at most 16 KiB")
    return passed


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


def _status(reply: bytes) -> int | None:
    """The status an encoded reply (`encode_reply`) carries; None if it holds none."""
    try:
        return decode_reply(reply).status
    except Refused:
        return None


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

    async def wait(self, timeout_s: float = 3.0) -> None:
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
        raise PeerUnreachable(
            f"POST {path} to {to[:12]}: no readable answer in the bucket within {timeout_s:.0f} s "
            "(none, one over the size limit, or the bucket unreadable)"
        )
    try:
        return decode_reply(raw)
    except Refused as exc:
        raise PeerUnreachable(f"POST {path} to {to[:12]}: unreadable answer: {exc.detail}") from None


class MailboxServer:
    """A relay replica's side (steps 2, 3, 4 and 6): requests from the bucket to its loopback server.

    Fair to every sender and bounded whatever is written to its inbox (module docstring): keys that
    are not ``{sender}/{token}`` are deleted unread; a sender's keys beyond `per_sender` are deleted
    (answered ones first); new requests are taken one per sender in turn, the senders served least
    recently first; whatever a request holds, it gets an answer (a refusal if nothing else), so it
    is never handed to the server twice; a request the bucket failed to hand over is read again on
    the next passes (`READ_TRIES`), not refused as unreadable; an answer that could not be uploaded
    is uploaded again, not recomputed."""

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
        self.refuses = routes.refuses
        self.reply_bytes = routes.reply_bytes
        self.request_timeout_s = routes.timeout_s
        self.log = log
        self.timings = timings
        self.served = 0
        self._answered: dict[str, float] = {}
        """Requests (``{sender}/{token}``) answered whose object is still there (the answer is kept
        until then, or until `MailboxTimings.linger_s` after it was written), and when."""
        self._unsent: dict[str, bytes] = {}
        """Answers computed whose upload failed: uploaded again, never recomputed (the server's
        nonce check would refuse the same request a second time)."""
        self._read_failures: dict[str, int] = {}
        """Requests the bucket failed to hand over (`transient`), and on how many passes."""
        self._busy: dict[str, asyncio.Task[None]] = {}
        self._last_served: dict[str, int] = {}
        """Sender → the pass in which one of its requests was last taken (fair turns)."""
        self._refused: dict[str, int] = {}
        """Sender → the pass in which one of its requests was last answered with a refusal
        (`REFUSED_STATUSES`): it waits behind the others for `REFUSED_PASSES` passes."""
        self._passes = 0
        self._swept = False
        self._after = ""
        """Where the next pass's LIST starts: after the last name of a full page, else at the start."""
        self.clearing = False
        """Whether the last pass had more than its page, or names to delete: poll again soon."""
        self.gap_s: float | None = None
        """The mean time between new requests (an exponential average), which sets the LIST rate."""
        self._session: aiohttp.ClientSession | None = None
        self._max_request = max(self.routes.values(), default=0) + MAX_HEAD_BYTES + HEAD.size

    @property
    def own(self) -> str:
        return self.store.wallet

    @property
    def inbox(self) -> str:
        return f"{REQUEST_PREFIX}/{self.own}/"

    async def run(self) -> None:
        """Serve until cancelled."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        loop = asyncio.get_running_loop()
        interval, active_until = self.timings.min_poll_s, 0.0
        last_new: float | None = None
        try:
            while True:
                try:
                    new = await self.pass_once()
                except Exception as exc:  # the bucket, or a bug: keep serving, and say so
                    self.log(f"bucket: a pass over pipeline requests failed: {type(exc).__name__}: {exc}")
                    new = 0
                now = loop.time()
                if new:
                    if last_new is not None:  # the mean time between requests, as an average of 0.3
                        gap = (now - last_new) / new
                        self.gap_s = gap if self.gap_s is None else 0.7 * self.gap_s + 0.3 * gap
                    last_new = now
                if new or self._busy or self.clearing:  # a page of junk is activity too
                    active_until = now + max(self.timings.active_s, 3 * (self.gap_s or 0.0))
                if now < active_until:
                    interval = poll_interval(self.gap_s, self.timings)
                else:
                    interval = min(interval * 1.5, self.timings.max_poll_s)
                await asyncio.sleep(interval)
        finally:
            for task in self._busy.values():
                task.cancel()
            await asyncio.gather(*self._busy.values(), return_exceptions=True)
            await self._session.close()

    async def pass_once(self) -> int:
        """One LIST page: clear what would fill the inbox, delete the answers whose request is gone,
        and start serving new requests; returns how many were started. A full page is followed by
        the next one on the next pass (names sort, so a page covers a range of them)."""
        self._passes += 1
        after = self._after
        listed, _ = await self.store.list_under(self.inbox, max_keys=MAX_LISTED, start_after=after)
        if not self._swept:
            await self._sweep(listed)
            return 0
        cut = len(listed) >= MAX_LISTED
        self._after = listed[-1] if cut else ""

        def covered(key: str) -> bool:
            """Whether this page would have listed `key` had it been there."""
            return key > after and (not cut or key <= listed[-1])

        junk = [key for key in listed if not REQUEST_KEY.fullmatch(key)]
        waiting = {key for key in listed if REQUEST_KEY.fullmatch(key)}
        now = asyncio.get_running_loop().time()
        gone = [key for key in self._answered if covered(key) and key not in waiting]
        stale = [
            k for k in waiting & self._answered.keys() if now - self._answered[k] > self.timings.linger_s
        ]
        excess = self._excess(waiting - set(stale))
        for key in sorted(set(gone + stale + excess) & self._answered.keys()):
            del self._answered[key]
            sender, _, token = key.partition("/")
            await self.store.delete(reply_name(sender, token))
        for kept in (self._unsent, self._read_failures):
            for key in list(kept):
                if key in excess or (covered(key) and key not in waiting):
                    del kept[key]
        dropped = stale + [key for key in excess if key not in self._busy]
        if junk or dropped:
            await self.store.delete_shared_many([self.inbox + key for key in junk + dropped])
            waiting.difference_update(dropped)
        self.clearing = bool(cut or junk or dropped)
        return self._start(waiting)

    async def _sweep(self, listed: list[str]) -> None:
        """The first pass: what an earlier run of this replica left. Its answers are not this run's
        to vouch for, and its requests may be replays (this run's nonce cache starts empty): each is
        answered 503, so its sender sends it again at once rather than after its timeout; other
        names go. `_swept` only once all of it is done (a failure leaves it for the next pass)."""
        answers, _ = await self.store.list_under(f"{self.own}/{REPLY_DIR}/", max_keys=MAX_LISTED)
        await self.store.delete_shared_many([f"{self.own}/{REPLY_DIR}/{a}" for a in answers])
        await self.store.delete_shared_many([self.inbox + k for k in listed if not REQUEST_KEY.fullmatch(k)])
        restarted = _refusal(503, "busy", "this replica restarted after the request was sent: send it again")
        for key in (k for k in listed if REQUEST_KEY.fullmatch(k)):
            sender, _, token = key.partition("/")
            await self.store.publish(reply_name(sender, token), restarted)
            self._answered[key] = asyncio.get_running_loop().time()
        self._swept = True

    def _excess(self, waiting: set[str]) -> list[str]:
        """Each sender's keys beyond `per_sender`, counting all it has here; answered ones go first,
        the longest answered first."""
        by_sender: dict[str, list[str]] = {}
        for key in waiting:
            by_sender.setdefault(key.partition("/")[0], []).append(key)
        excess: list[str] = []
        for sender, keys in sorted(by_sender.items()):
            if len(keys) <= self.timings.per_sender:
                continue
            keys.sort(key=lambda k: (k not in self._answered, self._answered.get(k, 0.0), k in self._busy, k))
            excess.extend(k for k in keys[: len(keys) - self.timings.per_sender] if k not in self._busy)
            self.log(
                f"bucket: {sender[:12]} has {len(keys)} pipeline requests here; "
                f"all but {self.timings.per_sender} deleted"
            )
        return excess

    def _start(self, waiting: set[str]) -> int:
        """Take new requests, one per sender in turn: senders refused lately last, then the least
        recently served first, a sender never served here as if served now (so that a crowd of
        new wallets does not go ahead of the senders already waiting their turn)."""
        queues: dict[str, list[str]] = {}
        for key in sorted(waiting - self._answered.keys() - self._busy.keys()):
            queues.setdefault(key.partition("/")[0], []).append(key)
        now = self._passes

        def turn(sender: str) -> tuple[bool, int, str]:
            refused = now - self._refused.get(sender, -REFUSED_PASSES - 1) <= REFUSED_PASSES
            return refused, self._last_served.get(sender, now), sender

        order = sorted(queues, key=turn)
        started = 0
        while order and len(self._busy) < self.timings.in_flight:
            sender = order.pop(0)
            key = queues[sender].pop(0)
            if queues[sender]:
                order.append(sender)
            task = asyncio.create_task(self._serve(key, self._unsent.pop(key, None)))
            self._busy[key] = task
            task.add_done_callback(functools.partial(self._done, key))
            self._last_served[sender] = self._passes
            started += 1
        for remembered in (self._last_served, self._refused):  # the longest unserved are forgotten
            if len(remembered) > MAX_REMEMBERED_SENDERS:
                for sender in sorted(remembered, key=remembered.__getitem__)[: len(remembered) // 2]:
                    del remembered[sender]
        return started

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        self._busy.pop(key, None)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.log(f"bucket: serving a pipeline request failed: {type(exc).__name__}: {exc}")

    async def _serve(self, key: str, reply: bytes | None) -> None:
        """Answer one request (or upload the answer an earlier try computed)."""
        sender, _, token = key.partition("/")
        if reply is None:
            try:
                reply = await self._answer(sender, token)
            except RelayError as exc:  # the bucket did not hand the request over: not the sender's fault
                tries = self._read_failures[key] = self._read_failures.get(key, 0) + 1
                if tries < READ_TRIES:
                    self.log(f"bucket: cannot read a pipeline request of {sender[:12]} (will retry): {exc}")
                    return  # still waiting and not answered: taken again by a later pass
                del self._read_failures[key]
                reply = _refusal(503, "busy", "this replica cannot read the request from the bucket")
            except Refused as exc:
                reply = _refusal(status_of(exc.code), exc.code, exc.detail)
            except Exception as exc:  # whatever the object held: answered, so never read again
                reply = _refusal(500, "step_failed", f"{type(exc).__name__}")
            self._read_failures.pop(key, None)
            if _status(reply) in REFUSED_STATUSES:
                self._refused[sender] = self._passes
        try:
            await self.store.publish(reply_name(sender, token), reply)
        except RelayError as exc:
            self._unsent[key] = reply
            self.log(f"bucket: cannot answer a pipeline request of {sender[:12]} (will retry): {exc}")
            return
        self._answered[key] = asyncio.get_running_loop().time()
        self.served += 1

    async def _answer(self, sender: str, token: str) -> bytes:
        why = None if self.refuses is None else self.refuses(sender)
        if why is not None:  # by the name it sent under; a name that lies is caught below, once read
            raise Refused("not_a_member", f"{why}: this replica takes no request from it (not read)")
        raw = await self.store.read_shared(request_path(self.own, sender, token), self._max_request)
        if raw is None:
            raise malformed("the request object is gone, too large or refused to this replica")
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
                    passed = {k: v for k, v in resp.headers.items() if PASSED_HEADERS.fullmatch(k)}
                    return encode_reply(resp.status, passed, data)
        except PeerUnreachable as exc:
            return _refusal(500, "step_failed", f"this replica's answer is unfit to send: {exc}")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return _refusal(503, "busy", f"this replica's server did not answer: {type(exc).__name__}")
