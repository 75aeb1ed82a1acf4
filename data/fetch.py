"""Fetching a published data set over HTTP: a CDN, a public bucket, or loopback in tests.

The layout under the base URL is a local data set's: `manifest.json`, `manifest.json.sig`,
`tokenizers/<sha256>.json`, `shard_{id}.pt`. Every file goes through one retry loop
(`_Client.download`): one request per attempt with connect and read timeouts, the body
streamed into a sink that hashes as it writes, `Range` resume after a dropped connection,
and full-jitter exponential backoff between attempts. A shard enters the disk cache only
once its sha256 matches the signed manifest. It is unpickled (with `weights_only`) only
after a hash check: the one made on the way in by this process, or `load_shard`'s from
disk for a file an earlier run left in the cache.

Start-up order for a node: `fetch_manifest`, `fetch_tokenizer`, then an `HttpShardSource`
with the tokenizer's vocabulary; `watch_manifest`/`newer_manifest` (or `refresh_manifest`)
for publications that appear while it trains.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar

import aiohttp
import torch

from .cache import PartialFile, ShardCache, commit_partial
from .files import file_sha256
from .manifest import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    Manifest,
    ManifestError,
    ShardInfo,
    TokenizerInfo,
    verify_manifest,
)
from .shards import ShardError, load_shard, read_tokens

T = TypeVar("T")
Log = Callable[[str], None]

TOKENIZER_CACHE_DIR = "tokenizers"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_TRANSIENT_STATUS = frozenset({408, 425, 429})
"""4xx codes that mean "try again later"; every other 4xx is final (missing or forbidden object)."""
_SIGNATURE_MAX_BYTES = 4096


@dataclass(kw_only=True)
class FetchConfig:
    retries: int = 5
    """Attempts after the first, per file, before giving up (6 requests at most). A dropped connection
    that delivered at least `progress_bytes` new bytes does not count: the next request resumes
    right away, and the size cap still bounds the total."""
    backoff_base_s: float = 0.5
    """Sleep before retry k (1, 2, …) is uniform in [0, min(cap, base·2^(k-1))] seconds: "full jitter"
    (M. Brooker, Exponential Backoff and Jitter, AWS Architecture Blog 2015), so nodes hit by the
    same CDN outage do not come back in lockstep."""
    backoff_cap_s: float = 30.0
    """Longest single backoff sleep, and longest Retry-After honoured, in seconds."""
    connect_timeout_s: float = 10.0
    """Seconds to get a connection (pool, DNS, TCP, TLS) for one request."""
    read_timeout_s: float = 30.0
    """Seconds the socket may stay silent mid-response before the request counts as dropped."""
    progress_bytes: int = 1 << 20
    """New bytes a dropped request must have delivered for its retry to be free (1 MiB)."""
    cache_bytes: int = 20 << 30
    """Disk cap for cached shards (20 GiB). The current shard and those being prefetched are never
    evicted, so they alone may exceed it."""
    prefetch: int = 2
    """At most this many of the shards passed to `prefetch()` are downloaded ahead of use."""
    manifest_refresh_s: float = 300.0
    """Seconds between manifest checks by `watch_manifest`: a publication every few hours at most,
    and a CDN-cached small file polled every 5 minutes costs nothing."""
    shard_overhead_bytes: int = 1 << 16
    """Allowance above 4 bytes/token for a shard file's zip header and padding (torch 2.13 writes
    ~1.6 KB); a body larger than 4·tokens + this is cut off and refetched."""
    manifest_max_bytes: int = 256 << 20
    """A manifest lists ~200 bytes per shard: 256 MiB leaves room for a million shards."""
    tokenizer_max_bytes: int = 64 << 20
    """Largest tokenizer file accepted; a 64k-merge vocabulary is a few MB."""
    chunk_bytes: int = 1 << 20
    """Largest read from the response stream; big reads mean fewer Python-level write/hash calls."""
    fsync: bool = False
    """fsync each download before renaming it into the cache. Off: every file from an earlier run
    is hashed again before first use, so one torn by a power cut is refetched anyway, and fsync
    took 0.1 s per 128 MB on the CI disk (measured) — half the time of a loopback download."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if value < 0 or (value == 0 and f.name not in ("retries", "prefetch", "backoff_base_s")):
                raise ValueError(f"FetchConfig.{f.name} = {value} is out of range")
        if self.backoff_cap_s < self.backoff_base_s:
            raise ValueError(f"backoff_cap_s {self.backoff_cap_s} < backoff_base_s {self.backoff_base_s}")

    def max_shard_bytes(self, info: ShardInfo) -> int:
        return 4 * info.tokens + self.shard_overhead_bytes

    def backoff(self, failures: int, rng: random.Random, *, retry_after: float | None = None) -> float:
        """Seconds to sleep after the `failures`-th failed attempt (1-based), full jitter, capped."""
        delay = rng.uniform(0.0, min(self.backoff_cap_s, self.backoff_base_s * 2 ** (failures - 1)))
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.backoff_cap_s))
        return delay


@dataclass
class FetchStats:
    """What the client did, for logs, tests and the benchmark."""

    requests: int = 0
    resumed: int = 0
    """Requests that asked for `Range: bytes=N-` to continue a dropped download."""
    manifest_not_modified: int = 0
    """Manifest polls the server answered 304 Not Modified (nothing downloaded)."""
    rejected: int = 0
    """Bodies thrown away: wrong sha256, oversized, HTML, bad encoding or Content-Range."""
    downloads: int = 0
    """Files downloaded whole and verified."""
    cache_hits: int = 0
    bytes: int = 0
    """Body bytes received, rejected ones included."""


class _Sink(Protocol):
    size: int

    def write(self, chunk: bytes) -> None: ...
    def reset(self) -> None: ...
    def hexdigest(self) -> str: ...


class _Buffer:
    """An in-memory sink for the small manifest files."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self.size = 0
        self.etag: str | None = None
        """The response's ETag, kept to ask `If-None-Match` on the next poll."""

    def write(self, chunk: bytes) -> None:
        self._parts.append(chunk)
        self.size += len(chunk)

    def reset(self) -> None:
        self._parts, self.size = [], 0

    def hexdigest(self) -> str:
        return hashlib.sha256(self.value()).hexdigest()

    def value(self) -> bytes:
        return b"".join(self._parts)


class _Failure(Exception):
    """One attempt went wrong. `restart`: the partial body is worthless; `final`: retrying cannot help."""

    def __init__(
        self, reason: str, *, restart: bool = False, final: bool = False, retry_after: float | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.restart = restart
        self.final = final
        self.retry_after = retry_after


class _NotModified(Exception):
    """304: the file is what the caller's `If-None-Match` named; nothing was downloaded."""


class _GaveUp(Exception):
    """A file could not be had within the retry budget; the caller turns it into its own error type."""


class _Client:
    """One aiohttp session and the retry policy; every request of this module goes through `download`.

    Create it inside a running event loop (aiohttp binds the session to it); `close` it there.
    """

    def __init__(self, config: FetchConfig, log: Log) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, connect=config.connect_timeout_s, sock_read=config.read_timeout_s
        )
        # auto_decompress off: we hash and store the bytes exactly as published.
        self.session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, read_bufsize=config.chunk_bytes
        )
        self.config = config
        self.stats = FetchStats()
        self._log = log
        self._rng = random.Random()

    async def close(self) -> None:
        await self.session.close()

    async def download(
        self,
        url: str,
        sink: _Sink,
        *,
        label: str,
        max_bytes: int,
        sha256: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Fill `sink` with the body of `url` (and check its sha256 if given) or raise _GaveUp."""
        failures, requests = 0, 0
        while True:
            before = sink.size
            requests += 1
            try:
                await self._attempt(url, sink, max_bytes, headers or {})
                if sha256 is not None and (actual := sink.hexdigest()) != sha256:
                    raise _Failure(
                        f"sha256 {actual[:16]}… of the {sink.size:,}-byte body is not the manifest's {sha256[:16]}…",
                        restart=True,
                    )
                self.stats.downloads += 1
                return
            except _Failure as exc:
                failure = exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                failure = _Failure(f"{type(exc).__name__}: {exc}".rstrip(": "))
            if failure.restart:
                self.stats.rejected += 1
                sink.reset()
            if failure.final:
                raise _GaveUp(f"{url}: {failure.reason}")
            if sink.size - before >= self.config.progress_bytes:
                self._log(
                    f"{label}: {failure.reason}; resuming at byte {sink.size:,} (free retry: it made progress)"
                )
                continue
            failures += 1
            if failures > self.config.retries:
                raise _GaveUp(f"gave up after {requests} requests to {url}; the last: {failure.reason}")
            delay = self.config.backoff(failures, self._rng, retry_after=failure.retry_after)
            resume = f", resuming at byte {sink.size:,}" if sink.size else ""
            self._log(
                f"{label}: {failure.reason}; retry {failures}/{self.config.retries} in {delay:.2f}s{resume}"
            )
            await asyncio.sleep(delay)

    async def _attempt(self, url: str, sink: _Sink, max_bytes: int, extra: dict[str, str]) -> None:
        # Ask for the bytes as stored: a compressed body would make Range offsets and the hash disagree.
        headers = {"Accept-Encoding": "identity", **extra}
        if sink.size:
            headers["Range"] = f"bytes={sink.size}-"
            self.stats.resumed += 1
        self.stats.requests += 1
        async with self.session.get(url, headers=headers, allow_redirects=True) as resp:
            if resp.status == 304 and "If-None-Match" in headers:
                raise _NotModified(url)
            if isinstance(sink, _Buffer):
                sink.etag = resp.headers.get("ETag")
            end = _accept(resp, sink.size, max_bytes)
            if resp.status == 200 and sink.size:
                sink.reset()  # the server ignored our Range and sends the whole file again
            async for chunk in resp.content.iter_chunked(self.config.chunk_bytes):
                self.stats.bytes += len(chunk)
                if sink.size + len(chunk) > max_bytes:
                    raise _Failure(f"body runs past the {max_bytes:,}-byte cap", restart=True)
                sink.write(chunk)
        if end is not None and sink.size != end:
            raise _Failure(f"body stopped at byte {sink.size:,} of {end:,}")


def _accept(resp: aiohttp.ClientResponse, offset: int, max_bytes: int) -> int | None:
    """Check status and headers before reading the body; returns the size the sink should reach."""
    if resp.status == 416:
        raise _Failure(f"server refused Range from byte {offset:,} (416)", restart=True)
    if resp.status not in (200, 206):
        transient = resp.status >= 500 or resp.status in _TRANSIENT_STATUS
        raise _Failure(
            f"server returned {resp.status} {resp.reason or ''}".rstrip(),
            final=not transient,
            retry_after=_retry_after(resp),
        )
    if resp.content_type == "text/html":
        raise _Failure("server sent an HTML page instead of the file", restart=True)
    encoding = resp.headers.get("Content-Encoding", "identity").lower()
    if encoding != "identity":
        raise _Failure(f"server sent a {encoding}-encoded body although we asked for identity", restart=True)
    length = resp.content_length
    if resp.status == 206:
        match = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
        if match is None or int(match[1]) != offset:
            raise _Failure(
                f"asked for bytes from {offset:,}, server sent Content-Range {resp.headers.get('Content-Range')!r}",
                restart=True,
            )
        total = None if match[3] == "*" else int(match[3])
        # A server may send less than we asked for; the next request then resumes from there.
        end: int | None = total if total is not None else int(match[2]) + 1
    else:
        end = total = length
    if total is not None and total > max_bytes:
        raise _Failure(
            f"server announces {total:,} bytes, more than the {max_bytes:,}-byte cap", restart=True
        )
    return end


def _retry_after(resp: aiohttp.ClientResponse) -> float | None:
    """Retry-After in seconds (the HTTP-date form is ignored: a CDN under load sends seconds)."""
    value = resp.headers.get("Retry-After", "")
    return float(value) if value.isdigit() else None


async def _fetch_manifest(
    client: _Client, base_url: str, publisher_key: bytes, *, etag: str | None = None
) -> tuple[Manifest, str | None]:
    """The verified manifest and its ETag. With `etag` (the one last seen), raises _NotModified
    when the server still has that manifest: a poll of a data set with 10⁵ shards then costs one
    small 304 instead of a multi-MB download and a signature check."""
    # no-cache: a CDN edge must revalidate, or it may pair a fresh manifest with a stale signature.
    fresh = {"Cache-Control": "no-cache"}
    url = f"{base_url}/{MANIFEST_NAME}"
    raw, sig = _Buffer(), _Buffer()
    try:
        await client.download(
            url,
            raw,
            label="manifest",
            max_bytes=client.config.manifest_max_bytes,
            headers={**fresh, "If-None-Match": etag} if etag else fresh,
        )
        await client.download(
            f"{base_url}/{SIGNATURE_NAME}",
            sig,
            label="manifest signature",
            max_bytes=_SIGNATURE_MAX_BYTES,
            headers=fresh,
        )
    except _GaveUp as exc:
        raise ManifestError(f"could not download the manifest: {exc}") from None
    return verify_manifest(raw.value(), sig.value(), publisher_key, url), raw.etag


async def _fetch_tokenizer(client: _Client, base_url: str, info: TokenizerInfo, cache_dir: Path) -> Path:
    if not _SHA256_HEX.fullmatch(info.sha256):
        raise ManifestError(f"tokenizer sha256 {info.sha256!r} is not 64 lowercase hex digits")
    # Named by our own hash, not the manifest's path, so no file name from the wire reaches the disk.
    path = cache_dir / TOKENIZER_CACHE_DIR / f"{info.sha256}.json"
    if path.is_file() and file_sha256(path) == info.sha256:
        client.stats.cache_hits += 1
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = PartialFile(path.parent / f".{path.name}.part")
    try:
        await client.download(
            f"{base_url}/{info.file}",
            partial,
            label=f"tokenizer {info.sha256[:16]}…",
            max_bytes=client.config.tokenizer_max_bytes,
            sha256=info.sha256,
        )
        commit_partial(partial, path, fsync=client.config.fsync)
    except _GaveUp as exc:
        partial.discard()
        raise ManifestError(f"tokenizer {info.sha256[:16]}… could not be fetched: {exc}") from None
    except BaseException:
        partial.discard()
        raise
    return path


async def _with_client(config: FetchConfig, log: Log, use: Callable[[_Client], Awaitable[T]]) -> T:
    client = _Client(config, log)
    try:
        return await use(client)
    finally:
        await client.close()


def _quiet(line: str) -> None:
    return None


def fetch_manifest(
    base_url: str, publisher_key: bytes, *, config: FetchConfig | None = None, log: Log = _quiet
) -> Manifest:
    """Download `manifest.json` + `.sig` from `base_url` and verify them against the pinned key.

    Raises ManifestError when they cannot be downloaded or do not verify.
    """
    base = _base(base_url)
    manifest, _ = asyncio.run(
        _with_client(config or FetchConfig(), log, lambda c: _fetch_manifest(c, base, publisher_key))
    )
    return manifest


def fetch_tokenizer(
    base_url: str,
    info: TokenizerInfo,
    cache_dir: Path,
    *,
    config: FetchConfig | None = None,
    log: Log = _quiet,
) -> Path:
    """The verified tokenizer file `info` names, from `cache_dir/tokenizers/` or downloaded into it.

    Raises ManifestError when it cannot be had with the right sha256.
    """
    base = _base(base_url)
    return asyncio.run(
        _with_client(config or FetchConfig(), log, lambda c: _fetch_tokenizer(c, base, info, cache_dir))
    )


def _base(base_url: str) -> str:
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"data URL {base_url!r} is not http:// or https://")
    return base_url.rstrip("/")


class HttpShardSource:
    """A `ShardSource` over HTTP with a disk cache, for the synchronous training loop.

    It runs its own event loop (one aiohttp session) on a background thread: `fetch` blocks
    until the shard is verified on disk and loaded, `prefetch` returns at once while the
    next shards download. Cache state is only touched on the loop thread.
    """

    def __init__(
        self, base_url: str, cache_dir: Path, vocab_size: int, *, config: FetchConfig, log: Log
    ) -> None:
        self._base = _base(base_url)
        self.vocab_size = vocab_size
        """Token ids must be below this; raise it when a newer manifest's tokenizer grows."""
        self._config = config
        self._log = log
        self._cache = ShardCache(cache_dir, config.cache_bytes, log, fsync=config.fsync)
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._prefetched: set[str] = set()
        self._current: str | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._newer: Manifest | None = None
        self._newer_lock = threading.Lock()
        self._last_manifest: tuple[str, Manifest] | None = None
        """(ETag, manifest) of the last manifest that verified, for conditional polls."""
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="neuroshard-fetch", daemon=True)
        self._thread.start()
        self._client = self._call(self._open())

    async def _open(self) -> _Client:
        return _Client(self._config, self._log)

    @property
    def stats(self) -> FetchStats:
        return self._client.stats

    @property
    def cache(self) -> ShardCache:
        return self._cache

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("HttpShardSource is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result()

    # -- shards -----------------------------------------------------------------------------

    def fetch(self, info: ShardInfo) -> torch.Tensor:
        for attempt in (1, 2):
            trusted = self._call(self._acquire(info))
            try:
                return self._load(info, trusted)
            except ShardError as exc:
                self._call(self._forget(info.file))
                if trusted or attempt == 2:
                    raise
                # A copy from an earlier run, damaged or torn since: worth one fresh download.
                self._log(
                    f"shard {info.id}: the cached copy failed verification ({exc}); deleted, fetching again"
                )
        raise AssertionError("unreachable")

    def _load(self, info: ShardInfo, trusted: bool) -> torch.Tensor:
        if not trusted:
            return load_shard(self._cache.directory, info, self.vocab_size)
        # Hashed on the way in by this process: hashing again from disk would double the cost
        # of a fetch on a fast link (measured: 760 MB/s read+hash vs ~550 MB/s loopback download).
        return read_tokens(self._cache.directory / info.file, info, self.vocab_size)

    def prefetch(self, infos: Sequence[ShardInfo]) -> None:
        if not self._closed:
            self._loop.call_soon_threadsafe(self._schedule, list(infos)[: self._config.prefetch])

    def wait_prefetched(self) -> None:
        """Block until every download under way has finished (or failed); for tests and benchmarks."""
        self._call(self._drain())

    async def _drain(self) -> None:
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def _acquire(self, info: ShardInfo) -> bool:
        """Make `info` the current shard and have it on disk; True if this process hashed it on the way in."""
        self._make_current(info.file)
        if info.file in self._cache and info.file not in self._inflight and self._cache.touch(info.file):
            self._client.stats.cache_hits += 1
        else:
            await asyncio.shield(self._start(info, prefetched=False))
        return self._cache.verified(info.file)

    async def _forget(self, name: str) -> None:
        self._cache.discard(name)

    def _make_current(self, name: str) -> None:
        # The shard being trained on stays pinned until the next one replaces it.
        self._cache.pin(name)
        if self._current is not None:
            self._cache.unpin(self._current)
        self._current = name
        if name in self._prefetched:
            self._prefetched.discard(name)
            self._cache.unpin(name)
        self._cache.make_room(0)  # what was pinned over the cap can go now

    def _schedule(self, infos: list[ShardInfo]) -> None:
        names = {info.file for info in infos}
        for name in self._prefetched - names:
            self._prefetched.discard(name)
            self._cache.unpin(name)
        for info in infos:
            if info.file == self._current:
                continue
            if info.file not in self._prefetched:
                self._prefetched.add(info.file)
                self._cache.pin(info.file)
            if info.file not in self._cache:
                self._start(info, prefetched=True)

    def _start(self, info: ShardInfo, *, prefetched: bool) -> asyncio.Task[None]:
        task = self._inflight.get(info.file)
        if task is None:
            task = self._loop.create_task(self._download(info))
            self._inflight[info.file] = task
            task.add_done_callback(lambda t: self._finished(info, prefetched, t))
        return task

    def _finished(self, info: ShardInfo, prefetched: bool, task: asyncio.Task[None]) -> None:
        self._inflight.pop(info.file, None)
        if task.cancelled():
            return
        exc = task.exception()  # retrieving it also keeps asyncio from reporting it as lost
        if exc is not None and prefetched:
            self._log(f"prefetch of shard {info.id} failed ({exc}); it will be tried again when it is needed")

    async def _download(self, info: ShardInfo) -> None:
        self._cache.pin(info.file)
        try:
            self._cache.make_room(4 * info.tokens)
            partial = self._cache.partial(info.file)
            try:
                await self._client.download(
                    f"{self._base}/{info.file}",
                    partial,
                    label=f"shard {info.id}",
                    max_bytes=self._config.max_shard_bytes(info),
                    sha256=info.sha256,
                )
                self._cache.commit(partial, info.file)
            except BaseException:
                # What arrived is a prefix that passed every check so far (a corrupt body resets
                # it to zero): keep it, so the next attempt — in this run or after a restart —
                # asks only for the rest.
                self._cache.keep(partial)
                raise
        except _GaveUp as exc:
            raise ShardError(f"shard {info.id}: not fetched, {exc}") from None
        except OSError as exc:
            raise ShardError(
                f"shard {info.id}: cannot write to the cache {self._cache.directory}: {exc}"
            ) from None
        finally:
            self._cache.unpin(info.file)

    # -- manifest and tokenizer ----------------------------------------------------------------

    def fetch_tokenizer(self, info: TokenizerInfo) -> Path:
        """The verified tokenizer file, cached under the cache directory's `tokenizers/`."""
        return self._call(_fetch_tokenizer(self._client, self._base, info, self._cache.directory))

    def refresh_manifest(self, current: Manifest) -> Manifest | None:
        """A newer valid manifest than `current`, or None (with an error logged if something was wrong).

        The publisher key is `current.publisher`: `verify_manifest` only returns manifests
        whose publisher is the pinned key, so a manifest from anyone else fails its signature.
        """
        return self._call(self._refresh(current))

    async def _refresh(self, current: Manifest) -> Manifest | None:
        key = bytes.fromhex(current.publisher)
        last = self._last_manifest
        try:
            new, etag = await _fetch_manifest(self._client, self._base, key, etag=last[0] if last else None)
        except _NotModified:
            assert last is not None
            self.stats.manifest_not_modified += 1
            new, etag = last[1], last[0]  # the bytes verified last time, unchanged on the server
        except ManifestError as exc:
            self._log(f"manifest refresh refused: {exc}; keeping version {current.version}")
            return None
        # Only a manifest that verified is remembered: a refused one is fetched whole again.
        self._last_manifest = (etag, new) if etag else None
        if new.version == current.version and new.to_bytes() == current.to_bytes():
            return None
        if new.version <= current.version:
            self._log(
                f"manifest refresh refused: the server has version {new.version}"
                f"{' with different contents' if new.version == current.version else ''}, "
                f"ours is {current.version}; keeping version {current.version}"
            )
            return None
        self._log(
            f"manifest version {new.version} accepted (was {current.version}): "
            f"{new.total_shards} shards, tokenizer {new.tokenizer.sha256[:16]}…"
        )
        return new

    def watch_manifest(self, current: Manifest) -> None:
        """Check for a newer manifest every `manifest_refresh_s` in the background; see `newer_manifest`."""
        self._loop.call_soon_threadsafe(self._start_watch, current)

    def _start_watch(self, current: Manifest) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self._watcher = self._loop.create_task(self._watch(current))

    async def _watch(self, in_force: Manifest) -> None:
        while True:
            await asyncio.sleep(self._config.manifest_refresh_s)
            newer = await self._refresh(in_force)
            if newer is not None:
                in_force = newer
                with self._newer_lock:
                    self._newer = newer

    def newer_manifest(self) -> Manifest | None:
        """The newest manifest the watcher accepted since the last call, or None. Never blocks."""
        with self._newer_lock:
            newer, self._newer = self._newer, None
        return newer

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel downloads under way (their partial files stay for the next run), close the session, stop the thread."""
        if self._closed:
            return
        self._closed = True  # first, so no prefetch slips in behind the shutdown
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        tasks = [*self._inflight.values(), *([self._watcher] if self._watcher else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.close()

    def __enter__(self) -> HttpShardSource:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
