"""The outer round's objects over the signed peer plane: the HTTP carrier of `outer.port`.

One route, behind the same signed-request middleware as every /p2p route:

| route                    | in -> out                                                   | ok      | refusals    |
|--------------------------|-------------------------------------------------------------|---------|-------------|
| GET /p2p/obj/{name}      | [`Range: bytes=a-b`] [`?wait=SECONDS`] -> the object's bytes | 200 206 | 400 404 416 |

Pull model: a replica publishes an object by putting it on its own `ObjectShelf` (memory, no
network I/O) and readers come and get it, so an object crosses the network once per reader that
needs it, and a crashed or slow author costs its readers a 404 or a timeout, not a stuck push.

`?wait=` is a long poll: when the object is not published yet, the request is held until it is
(or the wait, at most `MAX_WAIT_S`, ends: then 404 `not_published`). A reader asks once and gets
the bytes the moment they exist, instead of a polling loop that either hammers the author or
adds up to one poll interval of latency to every phase of the round.

`Range` (one range, `a-b` inclusive as in HTTP, or `a-`) lets the owner of a part read only that
part of each contributor's Δ: 206 with exactly those bytes, 416 when the range starts past the end.
Objects are served to any signed request: everything the round reads is signed by its author or
named by sha256 in something signed, so a carrier never needs to decide who may read.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus

from aiohttp import web

from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.signing import (
    NONCE_BYTES,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
)

from ..outer.port import Traffic, check_name, check_wallet
from .auth import PeerClient, PeerUnreachable, head_bytes, refusal_response

OBJECT = "/p2p/obj/{name:.+}"
MAX_WAIT_S = 30.0
"""Longest a server holds one long poll (`ObjectRoutes.max_wait_s`); `HttpRoundStore.fetch` asks again
for longer waits. Under the 60 s default read timeout of common reverse proxies (nginx's
proxy_read_timeout, an AWS load balancer's idle timeout), so a poll is never cut off by one."""
_RANGE = re.compile(r"^bytes=(\d{1,15})-(\d{0,15})$")
_AUTH_HEADERS = [
    (WALLET_HEADER, "0" * 64),
    (TIMESTAMP_HEADER, "0" * 13),  # Unix milliseconds: 13 digits until the year 2286
    (NONCE_HEADER, "0" * 2 * NONCE_BYTES),
    (SIGNATURE_HEADER, "0" * 128),
]
"""The four signed-request headers as `auth.sign_request` writes them: only their lengths count."""


class ShelfFull(Exception):
    """Publishing would exceed the shelf's byte or object bound."""


class ObjectShelf:
    """This replica's published objects, in memory: name -> bytes, bounded in total bytes and count.

    Readers waiting for a name hold an `asyncio.Event` that exists only while someone waits, so names
    asked for but never published leave nothing behind. Only the event loop touches a shelf."""

    def __init__(self, *, max_bytes: int, max_objects: int) -> None:
        if max_bytes < 0 or max_objects < 1:
            raise ValueError(
                f"ObjectShelf needs max_bytes >= 0, max_objects >= 1; got {max_bytes}, {max_objects}"
            )
        self.max_bytes = max_bytes
        self.max_objects = max_objects
        self.total_bytes = 0
        self.served = Traffic()
        """What readers fetched from this shelf (this replica's upload): heads and bodies answered."""
        self._objects: dict[str, bytes] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: Counter[str] = Counter()
        self._closed = False

    def __len__(self) -> int:
        return len(self._objects)

    @property
    def waiting(self) -> int:
        """Readers now long-polling for an object not yet published."""
        return sum(self._waiters.values())

    def get(self, name: str) -> bytes | None:
        return self._objects.get(name)

    def put(self, name: str, data: bytes) -> None:
        """Publish (or replace) `name`; ShelfFull with the numbers when a bound would be passed."""
        check_name(name)
        data = bytes(data)  # a reader must never see a caller's buffer change
        old = self._objects.get(name)
        if old is None and len(self._objects) >= self.max_objects:
            raise ShelfFull(
                f"shelf holds {len(self._objects)} objects (max {self.max_objects}); retire rounds"
            )
        total = self.total_bytes - (len(old) if old is not None else 0) + len(data)
        if total > self.max_bytes:
            raise ShelfFull(
                f"{name!r} of {len(data)} bytes would make the shelf {total} bytes (max {self.max_bytes})"
            )
        self._objects[name] = data
        self.total_bytes = total
        event = self._events.get(name)
        if event is not None:
            event.set()

    async def wait(self, name: str, timeout_s: float) -> bytes | None:
        """`name`'s bytes, waiting up to `timeout_s` for it to be published; None if it was not."""
        data = self._objects.get(name)
        if data is not None or timeout_s <= 0 or self._closed:
            return data
        event = self._events.setdefault(name, asyncio.Event())
        self._waiters[name] += 1
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            self._waiters[name] -= 1
            if not self._waiters[name]:
                del self._waiters[name]
                self._events.pop(name, None)
        return self._objects.get(name)

    def retire(self, stage: int, before_round: int) -> int:
        """Drop the objects of rounds < `before_round` of `stage`; returns how many."""
        old = [name for name in self._objects if _is_before(name, stage, before_round)]
        for name in old:
            self.total_bytes -= len(self._objects.pop(name))
        return len(old)

    def close(self) -> None:
        """Wake every waiting reader, and answer every later wait at once (server shutdown, or a node
        lingering after its last round): no long poll holds the shutdown up, while what is
        published is still served."""
        self._closed = True
        for event in self._events.values():
            event.set()


def _is_before(name: str, stage: int, before_round: int) -> bool:
    parts = name.split("/")
    return len(parts) >= 2 and parts[0] == str(stage) and parts[1].isdigit() and int(parts[1]) < before_round


def object_path(name: str, wait_s: float = 0.0) -> str:
    """The request path of `name` (with `?wait=` when waiting), as signed and sent."""
    path = f"/p2p/obj/{check_name(name)}"
    return f"{path}?wait={wait_s:.3f}" if wait_s > 0 else path


class ObjectRoutes:
    """GET /p2p/obj/{name} serving an `ObjectShelf`; a `server.ServerExtension`."""

    ROUTE = "object_get"

    def __init__(self, shelf: ObjectShelf, *, max_wait_s: float = MAX_WAIT_S) -> None:
        self.shelf = shelf
        self.max_wait_s = max_wait_s

    def body_limit(self, route: str) -> int | None:
        return 0 if route == self.ROUTE else None  # a GET carries no body

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(OBJECT, self._get, name=self.ROUTE, allow_head=False)

        async def wake_waiters(app: web.Application) -> None:
            self.shelf.close()

        app.on_shutdown.append(wake_waiters)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        try:
            response = await self._answer(request)
        except Refused as exc:
            response = refusal_response(exc)
        served = self.shelf.served
        served.requests += 1
        served.bytes_received += head_bytes(
            f"{request.method} {request.raw_path} HTTP/1.1", request.raw_headers
        )
        served.bytes_sent += head_bytes(
            f"HTTP/1.1 {response.status} {response.reason}", response.headers.items()
        )
        served.bytes_sent += response.content_length or 0
        return response

    async def _answer(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        try:
            check_name(name)
        except ValueError as exc:
            raise Refused("bad_name", str(exc)) from None
        data = await self.shelf.wait(name, self._wait_s(request))
        if data is None:
            raise Refused("not_published", f"no object {name!r} is published here")
        raw_range = request.headers.get("Range")
        if raw_range is None:
            return web.Response(status=200, body=data, content_type="application/octet-stream")
        start, end = _parse_range(raw_range, len(data))  # [start, end)
        return web.Response(
            status=206,
            body=data[start:end],  # bytes, not a memoryview: Content-Length is then known to count traffic
            headers={"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"},
            content_type="application/octet-stream",
        )

    def _wait_s(self, request: web.Request) -> float:
        raw = request.query.get("wait")
        if raw is None:
            return 0.0
        try:
            wait_s = float(raw)
        except ValueError:
            wait_s = math.nan
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise Refused("bad_wait", f"wait={raw[:20]!r} is not a non-negative number of seconds")
        return min(wait_s, self.max_wait_s)


def _parse_range(raw: str, size: int) -> tuple[int, int]:
    """`bytes=a-b` (b inclusive, clamped to the end as in HTTP) or `bytes=a-` -> [a, b + 1)."""
    match = _RANGE.match(raw)
    if match is None:
        raise Refused("bad_range", f"Range {raw[:40]!r} is not one 'bytes=a-b' or 'bytes=a-'")
    start = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else size - 1
    if start >= size or last < start:
        raise Refused("unsatisfiable_range", f"Range {raw[:40]!r} is outside the object's {size} bytes")
    return start, min(last, size - 1) + 1


class HttpRoundStore:
    """`outer.port.RoundStore` over the peer plane: publish onto this replica's shelf, fetch by signed GET.

    `locate(wallet)` gives an author's "host:port" (None: unknown, the fetch answers None). Reads of
    this replica's own objects go to its shelf. `traffic` counts the requests this store sent and
    the bytes of their heads and bodies, as `auth.Traffic` does (aiohttp's default Accept,
    Accept-Encoding and User-Agent request headers, ~90 bytes, are left out); a publish counts as a
    request and moves no bytes, as in `port.MemoryStore`."""

    def __init__(
        self,
        *,
        wallet: str,
        shelf: ObjectShelf,
        client: PeerClient,
        locate: Callable[[str], str | None],
        transfer_timeout_s: float = 60.0,
        max_poll_s: float = MAX_WAIT_S,
    ) -> None:
        self.wallet = check_wallet(wallet)
        self.shelf = shelf
        self.client = client
        self.locate = locate
        self.transfer_timeout_s = transfer_timeout_s
        """Added to each request's wait: the time its reply may take once the object is there."""
        self.max_poll_s = max_poll_s
        """The authors' `ObjectRoutes.max_wait_s`: a longer wait is asked for in polls of this length."""
        self.traffic = Traffic()

    async def publish(self, name: str, data: bytes) -> None:
        self.shelf.put(name, data)
        self.traffic.requests += 1

    async def retire(self, stage: int, before_round: int) -> None:
        self.shelf.retire(stage, before_round)

    async def fetch(
        self,
        author: str,
        name: str,
        *,
        max_bytes: int,
        span: tuple[int, int] | None = None,
        wait_s: float = 0.0,
    ) -> bytes | None:
        check_wallet(author)
        check_name(name)
        if span is not None and not 0 <= span[0] <= span[1]:
            raise ValueError(f"span {span} is not 0 <= start <= end")
        if span is not None and span[0] == span[1]:
            return b""
        if span is not None and span[1] - span[0] > max_bytes:
            return None
        if author == self.wallet:
            data = await self.shelf.wait(name, wait_s)
            if data is not None and span is not None:
                data = data[span[0] : span[1]] if span[1] <= len(data) else None
            return data if data is not None and len(data) <= max_bytes else None
        address = self.locate(author)
        if address is None:
            return None
        status, body = await self._poll(address, name, span, max_bytes, wait_s)
        if (status == 200 and span is None) or (status == 206 and span is not None):
            expected = len(body) if span is None else span[1] - span[0]
            if len(body) == expected <= max_bytes:
                return body
        return None

    async def _poll(
        self, address: str, name: str, span: tuple[int, int] | None, max_bytes: int, wait_s: float
    ) -> tuple[int, bytes]:
        """The last (status, body) of long polls of at most `max_poll_s` each, until `wait_s` has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            asked = loop.time()
            poll_s = min(max(deadline - asked, 0.0), self.max_poll_s)
            status, body = await self._get(address, object_path(name, poll_s), span, max_bytes, poll_s)
            held = loop.time() - asked >= 0.9 * poll_s  # a 404 at once (shutting down) is not re-asked
            if status != 404 or poll_s == 0 or not held or loop.time() >= deadline:
                return status, body

    async def _get(
        self, address: str, path: str, span: tuple[int, int] | None, max_bytes: int, wait_s: float
    ) -> tuple[int, bytes]:
        """(status, body) of one signed GET; (0, b"") when the author did not answer usefully."""
        headers = {} if span is None else {"Range": f"bytes={span[0]}-{span[1] - 1}"}
        self.traffic.requests += 1
        try:
            reply = await self.client.request(
                "GET",
                address,
                path,
                max_bytes=max_bytes,
                headers=headers,
                timeout_s=wait_s + self.transfer_timeout_s,
            )
        except PeerUnreachable:
            return 0, b""
        sent = [*headers.items(), *_AUTH_HEADERS, ("Host", address)]
        self.traffic.bytes_sent += head_bytes(f"GET {path} HTTP/1.1", sent)
        try:
            reason = HTTPStatus(reply.status).phrase
        except ValueError:
            reason = ""
        self.traffic.bytes_received += len(reply.body)
        self.traffic.bytes_received += head_bytes(f"HTTP/1.1 {reply.status} {reason}", reply.headers.items())
        return reply.status, reply.body
