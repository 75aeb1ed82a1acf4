"""Read responses rendered once and served many times: ETag, Cache-Control, 304 and HEAD.

A read endpoint hands `ReadCache.get` a key and a function that renders its body from the
database. The rendered bytes are kept and served to every request until they are stale:

- a write committed in this process (`Database.generation` moved) makes them stale, but they
  are re-rendered at most every `min_interval_s`, so a thousand nodes writing do not turn
  every read into a recomputation;
- whatever happens, they are re-rendered once they are `max_age_s` old (writes committed
  by other worker processes, the clock moving nodes out of the peer TTL).

With `background=True` (the service) a stale body is still served while one background
thread re-renders it, so no request ever waits on the database except the very first one
for a key. Measured in issue 15: `/api/training/verify` recomputed per request served
0.37x a bare FastAPI endpoint; history over 200,000 receipts took 3.3 s per GET.

Bodies carry a strong ETag (sha256 of the bytes) and `Cache-Control: public, max-age=…`, so
a CDN or reverse proxy can serve them too; `If-None-Match` gets 304 with no body.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from neuroshard.verifier.config import ReadCacheConfig

log = logging.getLogger(__name__)

JSON = "application/json"


@dataclass(frozen=True)
class Rendered:
    body: bytes
    etag: str
    """Quoted strong validator: '"' + sha256(body)[:32] + '"'."""
    rendered_at: float
    generation: int
    """The database's write generation when rendering started (writes after it make this stale)."""
    headers: tuple[tuple[str, str], ...] = ()
    """Extra response headers that belong to the body (X-Total-Count, Link)."""


def etag_of(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


class ReadCache:
    """Rendered bodies by key, refreshed as the module docstring says."""

    def __init__(
        self, config: ReadCacheConfig, *, clock: Callable[[], float], generation: Callable[[], int]
    ) -> None:
        self.config = config
        self._clock = clock
        self._generation = generation
        self._entries: OrderedDict[str, Rendered] = OrderedDict()
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._refreshing: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        self.renders = 0
        """Bodies rendered since start (tests and /metrics: how rarely reads touch the database)."""

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _fresh(self, entry: Rendered) -> bool:
        age = self._clock() - entry.rendered_at
        if age < 0 or age >= self.config.max_age_s:
            return False
        return entry.generation == self._generation() or age < self.config.min_interval_s

    def get(self, key: str, render: Callable[[], tuple[bytes, tuple[tuple[str, str], ...]]]) -> Rendered:
        """The body for `key`, rendering it (here or in the background) when missing or stale.
        `render` returns the body and its extra headers; an exception from it propagates to the
        request that rendered synchronously and leaves nothing cached."""
        entry = self.peek(key, render)
        return entry if entry is not None else self._render(key, render)

    def peek(
        self, key: str, render: Callable[[], tuple[bytes, tuple[tuple[str, str], ...]]]
    ) -> Rendered | None:
        """The body for `key` if serving it needs no rendering here: fresh, or stale while a
        background thread re-renders it. None when the caller must render (`get`, on a thread
        that may block). Never touches the database, so an async route may call it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None and self._fresh(entry):
            return entry
        if entry is not None and self.config.background:
            self._refresh_later(key, render)
            return entry
        return None

    def _render(self, key: str, render: Callable[[], tuple[bytes, tuple[tuple[str, str], ...]]]) -> Rendered:
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one rendering per key at a time; the others take its result
            with self._lock:
                entry = self._entries.get(key)
            if entry is not None and self._fresh(entry):
                return entry
            generation, started = self._generation(), self._clock()
            body, headers = render()
            entry = Rendered(body, etag_of(body), started, generation, headers)
            with self._lock:
                self.renders += 1
                self._entries[key] = entry
                self._entries.move_to_end(key)
                while len(self._entries) > self.config.max_entries:
                    old, _ = self._entries.popitem(last=False)
                    self._key_locks.pop(old, None)
            return entry

    def _refresh_later(
        self, key: str, render: Callable[[], tuple[bytes, tuple[tuple[str, str], ...]]]
    ) -> None:
        with self._lock:
            if key in self._refreshing:
                return
            self._refreshing.add(key)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="read-cache")
            pool = self._pool

        def refresh() -> None:
            try:
                self._render(key, render)
            except Exception as exc:  # the stale body keeps being served; the next request retries
                log.warning("re-rendering %s failed: %s: %s", key, type(exc).__name__, exc)
            finally:
                with self._lock:
                    self._refreshing.discard(key)

        try:
            pool.submit(refresh)
        except RuntimeError:  # shut down while the app stops
            with self._lock:
                self._refreshing.discard(key)


def _matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    if if_none_match.strip() == "*":
        return True
    # Weak comparison (RFC 9110 §13.1.2): a proxy may have weakened our tag to W/"…".
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return etag in tags


def cached_response(
    request: Request, entry: Rendered, *, max_age_s: float, media_type: str = JSON
) -> Response:
    """200 with the body, or 304 when the client already holds this ETag."""
    headers = {
        "ETag": entry.etag,
        "Cache-Control": f"public, max-age={int(max_age_s)}",
        **dict(entry.headers),
    }
    if _matches(request.headers.get("if-none-match"), entry.etag):
        return Response(status_code=304, headers=headers)
    return Response(content=entry.body, media_type=media_type, headers=headers)


HEAD_SCOPE_KEY = "neuroshard.head"
"""Set in the ASGI scope of a HEAD request that HeadAsGet routes as GET: an endpoint whose body is
costly to make (a streamed file) checks it and answers with the headers alone."""


class HeadAsGet:
    """HEAD answered wherever GET is: routed as GET, the body dropped, the headers kept
    (Content-Length included, as RFC 9110 §9.3.2 allows). FastAPI routes declared with
    `@router.get` otherwise answer HEAD with 405."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        # In place, so middleware outside this one sees the route the router set.
        scope["method"] = "GET"
        scope[HEAD_SCOPE_KEY] = True
        try:
            await self.app(scope, receive, headers_only)
        finally:
            scope["method"] = "HEAD"
