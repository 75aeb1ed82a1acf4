"""The narrow port between the outer round and whatever carries its bytes.

The round (``neuroshard.node.outer.round``) is written against two verbs and nothing else:

- ``publish(name, data)``: make one of this replica's round objects readable by the stage
  (its commitment, its encoded Δ, an aggregated part, a claim, a digest, a fraud proof);
- ``fetch(author, name, span=…, wait_s=…)``: read another replica's object, or a byte range of
  it (an owner reads only its part of each contributor's Δ), waiting up to ``wait_s`` for it to
  appear.

It is a pull model: every object lives with its author — in its aiohttp peer server
(``neuroshard.node.p2p.objects``), under its prefix of an S3-compatible bucket
(``neuroshard.node.p2p.bucket``, for replicas with outbound connections only) or in memory
(``MemoryHub``, the simulator and the unit tests) — and readers come and get it. A stage can
mix carriers: ``RoutedStore`` sends each read to where its author publishes.

Nothing a port returns is trusted. Every object the round reads is signed by its author, or
is bytes whose sha256 a signed object names; the round checks both before it uses a byte. A
port only moves bytes and counts them (``Traffic``); it never imports the round, the DiLoCo
engine or the aggregation rules.

Object names are short relative paths, ``{stage}/{round}/{kind}[/{part}]`` (``object_name``),
made of ``[a-z0-9/_-]`` only, so every carrier can use them as a URL path segment or key suffix.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

NAME_PATTERN = re.compile(r"^[a-z0-9_\-]+(/[a-z0-9_\-]+){0,5}$")
MAX_NAME_CHARS = 128
WALLET_PATTERN = re.compile(r"^[0-9a-f]{64}$")


def object_name(stage: int, round_: int, kind: str, part: int | None = None) -> str:
    """`{stage}/{round}/{kind}` or `{stage}/{round}/{kind}/{part}`; `kind` from the round module."""
    name = f"{stage}/{round_}/{kind}" if part is None else f"{stage}/{round_}/{kind}/{part}"
    check_name(name)
    return name


def check_name(name: str) -> str:
    """`name` if it is a valid object name, else ValueError saying why (carriers call it on input)."""
    if len(name) > MAX_NAME_CHARS or not NAME_PATTERN.match(name):
        raise ValueError(
            f"object name {name[:40]!r} is not [a-z0-9_-] segments of at most {MAX_NAME_CHARS} chars"
        )
    return name


def check_wallet(author: str) -> str:
    if not WALLET_PATTERN.match(author):
        raise ValueError(f"author {author[:20]!r} is not a wallet (64 lowercase hex characters)")
    return author


@dataclass
class Traffic:
    """What a store moved for its replica: bodies and (for HTTP) heads; requests = messages."""

    bytes_sent: int = 0
    bytes_received: int = 0
    requests: int = 0
    """Fetches and publishes this replica made (its own outgoing messages)."""


class RoundStore(Protocol):
    """One replica's view of the carrier: publish its own objects, fetch others'."""

    @property
    def traffic(self) -> Traffic:
        """What this store moved for its replica so far (read-only for callers)."""
        ...

    async def publish(self, name: str, data: bytes) -> None:
        """Make `data` readable as (this replica's wallet, `name`); replaces an earlier object of the
        same name (a replica only ever re-publishes identical bytes; the round never relies on it)."""
        ...

    async def fetch(
        self,
        author: str,
        name: str,
        *,
        max_bytes: int,
        span: tuple[int, int] | None = None,
        wait_s: float = 0.0,
    ) -> bytes | None:
        """`author`'s object `name` (bytes [start, end) of it when `span` is given), waiting up to
        `wait_s` seconds for it to be published; None if it is absent, larger than `max_bytes`, or
        unreachable. Never raises for transport failures."""
        ...

    async def retire(self, stage: int, before_round: int) -> None:
        """Forget (delete) this replica's objects of rounds < `before_round` of `stage`."""
        ...


class MemoryHub:
    """Every replica's objects in one process: the in-memory carrier of the simulator and tests.

    `drop(author)` makes an author unreachable (a crashed replica). Objects are bytes, so a reader can never alias an author's buffers."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}
        self._published: dict[tuple[str, str], asyncio.Event] = {}
        self.down: set[str] = set()
        self.stores: dict[str, MemoryStore] = {}

    def store(self, wallet: str) -> MemoryStore:
        store = self.stores[wallet] = MemoryStore(self, check_wallet(wallet))
        return store

    def _event(self, key: tuple[str, str]) -> asyncio.Event:
        event = self._published.get(key)
        if event is None:
            event = self._published[key] = asyncio.Event()
        return event

    def drop(self, author: str) -> None:
        self.down.add(author)


class MemoryStore:
    """`RoundStore` over a `MemoryHub` (counts the bytes a network carrier would move)."""

    def __init__(self, hub: MemoryHub, wallet: str) -> None:
        self.hub = hub
        self.wallet = wallet
        self.traffic = Traffic()
        self.served = Traffic()
        """What readers fetched from this replica (its upload), for per-node byte counts."""

    async def publish(self, name: str, data: bytes) -> None:
        check_name(name)
        key = (self.wallet, name)
        self.hub.objects[key] = bytes(data)
        self.hub._event(key).set()
        self.traffic.requests += 1

    async def fetch(
        self,
        author: str,
        name: str,
        *,
        max_bytes: int,
        span: tuple[int, int] | None = None,
        wait_s: float = 0.0,
    ) -> bytes | None:
        check_name(name)
        key = (author, name)
        self.traffic.requests += 1
        if author in self.hub.down:
            return None
        if key not in self.hub.objects and wait_s > 0:
            try:
                await asyncio.wait_for(self.hub._event(key).wait(), wait_s)
            except TimeoutError:
                return None
        data = self.hub.objects.get(key)
        if data is None or author in self.hub.down:
            return None
        if span is not None:
            start, end = span
            if not 0 <= start <= end <= len(data):
                return None
            data = data[start:end]
        if len(data) > max_bytes:
            return None
        self.traffic.bytes_received += len(data)
        author_store = self.hub.stores.get(author)
        if author_store is not None:
            author_store.served.bytes_sent += len(data)
        return data

    async def retire(self, stage: int, before_round: int) -> None:
        for author, name in list(self.hub.objects):
            if author != self.wallet:
                continue
            parts = name.split("/")
            if (
                len(parts) >= 2
                and parts[0] == str(stage)
                and parts[1].isdigit()
                and int(parts[1]) < before_round
            ):
                del self.hub.objects[(author, name)]
                self.hub._published.pop((author, name), None)


class RoutedStore:
    """A mixed stage: publish through this replica's own carrier, read each author through the carrier
    it publishes on (`route(author)` -> that store; e.g. the bucket for replicas behind NAT, HTTP for
    the others). Traffic is the sum over the carriers used."""

    def __init__(self, own: RoundStore, route: Callable[[str], RoundStore]) -> None:
        self.own = own
        self.route = route
        self._used: dict[int, RoundStore] = {id(own): own}

    @property
    def traffic(self) -> Traffic:
        total = Traffic()
        for store in self._used.values():
            total.bytes_sent += store.traffic.bytes_sent
            total.bytes_received += store.traffic.bytes_received
            total.requests += store.traffic.requests
        return total

    async def publish(self, name: str, data: bytes) -> None:
        await self.own.publish(name, data)

    async def fetch(
        self,
        author: str,
        name: str,
        *,
        max_bytes: int,
        span: tuple[int, int] | None = None,
        wait_s: float = 0.0,
    ) -> bytes | None:
        store = self.route(author)
        self._used.setdefault(id(store), store)
        return await store.fetch(author, name, max_bytes=max_bytes, span=span, wait_s=wait_s)

    async def retire(self, stage: int, before_round: int) -> None:
        await self.own.retire(stage, before_round)
