"""The outer round's objects over HTTP: two real peer servers on loopback, each with its shelf.

Replica A publishes; replica B fetches through `HttpRoundStore` (signed GETs through a real
`PeerClient`), or sends hand-built requests to check the route's refusals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
import pytest_asyncio
from aiohttp import ClientSession, test_utils

from neuroshard.node.outer.port import RoundStore, object_name
from neuroshard.node.p2p.auth import PeerClient
from neuroshard.node.p2p.objects import HttpRoundStore, ObjectRoutes, ObjectShelf, ShelfFull, object_path
from neuroshard.node.p2p.server import NodeState, build_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import ErrorReply
from neuroshard.protocol.signing import sign_request

DELTA = bytes(range(256)) * 40  # 10240 bytes, every offset distinguishable mod 256
NAME = object_name(0, 3, "delta")
POLL_S = 0.3
"""The servers' long-poll cap in these tests, so a wait longer than one poll is cheap to test."""


@dataclass
class Replica:
    node: NodeState
    wallet: Wallet
    shelf: ObjectShelf
    server: test_utils.TestServer
    client: PeerClient
    store: HttpRoundStore

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@dataclass
class Pair:
    a: Replica
    b: Replica
    session: ClientSession

    async def send(
        self, path: str, headers: dict[str, str] | None = None, *, signed: bool = True
    ) -> tuple[int, bytes]:
        """A GET from B to A's server built by hand (unsigned when `signed` is False)."""
        auth = sign_request(self.b.wallet, "GET", path, b"", time.time()) if signed else {}
        async with self.session.get(self.a.server.make_url(path), headers={**(headers or {}), **auth}) as r:
            return r.status, await r.read()


def _error_code(body: bytes) -> str:
    return ErrorReply.from_json(body).error


async def _replica(
    node: NodeState, wallet: Wallet, locate: Callable[[str], str | None], poll_s: float = POLL_S
) -> Replica:
    shelf = ObjectShelf(max_bytes=1 << 20, max_objects=64)
    app = build_app(node, window_s=60.0, extensions=[ObjectRoutes(shelf, max_wait_s=poll_s)])
    server = test_utils.TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    client = PeerClient(wallet, connect_timeout_s=2.0, request_timeout_s=10.0)
    await client.start()
    store = HttpRoundStore(
        wallet=wallet.public_key_hex, shelf=shelf, client=client, locate=locate, max_poll_s=poll_s
    )
    return Replica(node, wallet, shelf, server, client, store)


@pytest_asyncio.fixture
async def pair(make_node, wallets) -> AsyncIterator[Pair]:
    addresses: dict[str, str] = {}
    a = await _replica(make_node(wallets[0]), wallets[0], addresses.get)
    b = await _replica(make_node(wallets[1]), wallets[1], addresses.get)
    addresses.update({a.wallet.public_key_hex: a.address, b.wallet.public_key_hex: b.address})
    async with ClientSession() as session:
        yield Pair(a, b, session)
    for replica in (a, b):
        await replica.client.close()
        await replica.server.close()


def _a(pair: Pair) -> str:
    return pair.a.wallet.public_key_hex


@pytest.mark.asyncio
async def test_publish_then_fetch_whole(pair: Pair) -> None:
    author: RoundStore = pair.a.store  # the port's protocol, checked by mypy
    await author.publish(NAME, DELTA)
    assert pair.a.client.traffic.requests == 0  # publishing moves no bytes
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=len(DELTA)) == DELTA
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=len(DELTA) - 1) is None  # over max_bytes


@pytest.mark.asyncio
async def test_ranged_fetch_returns_exactly_the_span(pair: Pair) -> None:
    await pair.a.store.publish(NAME, DELTA)
    for start, end in [(100, 357), (0, 1), (len(DELTA) - 10, len(DELTA)), (0, len(DELTA))]:
        got = await pair.b.store.fetch(_a(pair), NAME, max_bytes=end - start, span=(start, end))
        assert got == DELTA[start:end], (start, end)
    requests = pair.b.store.traffic.requests
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=0, span=(5, 5)) == b""
    assert pair.b.store.traffic.requests == requests  # an empty span asks nothing
    status, body = await pair.send(object_path(NAME), {"Range": "bytes=10-19"})
    assert (status, body) == (206, DELTA[10:20])


@pytest.mark.asyncio
async def test_unsatisfiable_or_malformed_range_is_refused(pair: Pair) -> None:
    await pair.a.store.publish(NAME, DELTA)
    size = len(DELTA)
    status, body = await pair.send(object_path(NAME), {"Range": f"bytes={size}-{size + 4}"})
    assert (status, _error_code(body)) == (416, "unsatisfiable_range")
    status, body = await pair.send(object_path(NAME), {"Range": "bytes=9-3"})
    assert (status, _error_code(body)) == (416, "unsatisfiable_range")
    status, body = await pair.send(object_path(NAME), {"Range": "bytes=0-1,5-6"})
    assert (status, _error_code(body)) == (400, "bad_range")
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=size, span=(size + 1, size + 5)) is None
    # Past the end the server clamps (HTTP); the short 206 is not the span asked for.
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=size, span=(size - 5, size + 5)) is None


@pytest.mark.asyncio
async def test_fetch_waits_for_a_publish_during_the_wait(pair: Pair) -> None:
    async def publish_later() -> None:
        await asyncio.sleep(0.2)
        await pair.a.store.publish(NAME, DELTA)

    started = time.monotonic()
    publisher = asyncio.create_task(publish_later())
    got = await pair.b.store.fetch(_a(pair), NAME, max_bytes=len(DELTA), wait_s=5.0)
    await publisher
    assert got == DELTA
    assert 0.15 < time.monotonic() - started < 2.0  # woken by the publish, not by the wait's end
    assert pair.b.store.traffic.requests == 1


@pytest.mark.asyncio
async def test_a_wait_longer_than_one_poll_asks_again(pair: Pair) -> None:
    async def publish_later() -> None:
        await asyncio.sleep(2.5 * POLL_S)
        await pair.a.store.publish(NAME, DELTA)

    publisher = asyncio.create_task(publish_later())
    got = await pair.b.store.fetch(_a(pair), NAME, max_bytes=len(DELTA), wait_s=10 * POLL_S)
    await publisher
    assert got == DELTA
    assert pair.b.store.traffic.requests == 3  # two polls that ended empty, the third got it


@pytest.mark.asyncio
async def test_absent_object_is_none_at_once_or_when_the_wait_ends(pair: Pair) -> None:
    started = time.monotonic()
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=1 << 20) is None
    assert time.monotonic() - started < 1.0
    started = time.monotonic()
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=1 << 20, wait_s=0.5) is None
    assert 0.45 < time.monotonic() - started < 3.0
    status, body = await pair.send(object_path(NAME))
    assert (status, _error_code(body)) == (404, "not_published")
    assert not pair.a.shelf._events  # no waiter left anything behind


@pytest.mark.asyncio
async def test_unknown_or_unreachable_author_is_none(pair: Pair, wallets: list[Wallet]) -> None:
    stranger = wallets[2].public_key_hex
    assert await pair.b.store.fetch(stranger, NAME, max_bytes=100) is None
    pair.b.store.locate = lambda wallet: "127.0.0.1:1"  # nothing listens there
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=100) is None


@pytest.mark.asyncio
async def test_unsigned_or_forged_request_is_401(pair: Pair) -> None:
    await pair.a.store.publish(NAME, DELTA)
    status, body = await pair.send(object_path(NAME), signed=False)
    assert (status, _error_code(body)) == (401, "unsigned")
    path = object_path(NAME)
    forged = sign_request(pair.b.wallet, "GET", object_path(object_name(0, 3, "other")), b"", time.time())
    async with pair.session.get(pair.a.server.make_url(path), headers=forged) as r:
        assert (r.status, _error_code(await r.read())) == (401, "bad_signature")
    assert pair.a.shelf.served.requests == 0  # refused before the route


@pytest.mark.asyncio
async def test_invalid_name_or_wait_is_400(pair: Pair) -> None:
    for path in ["/p2p/obj/0/3/Delta", "/p2p/obj/0/3/de.lta", "/p2p/obj/" + "a/" * 6 + "b"]:
        status, body = await pair.send(path)
        assert (status, _error_code(body)) == (400, "bad_name"), path
    for wait in ["-1", "nan", "inf", "soon"]:
        status, body = await pair.send(f"{object_path(NAME)}?wait={wait}")
        assert (status, _error_code(body)) == (400, "bad_wait"), wait
    with pytest.raises(ValueError, match="object name"):
        await pair.b.store.fetch(_a(pair), "0/3/Delta", max_bytes=100)


@pytest.mark.asyncio
async def test_own_objects_are_read_from_the_shelf(pair: Pair) -> None:
    await pair.a.store.publish(NAME, DELTA)
    own = pair.a.wallet.public_key_hex
    assert await pair.a.store.fetch(own, NAME, max_bytes=len(DELTA), span=(3, 9)) == DELTA[3:9]
    assert pair.a.client.traffic.requests == 0


@pytest.mark.asyncio
async def test_retire_drops_older_rounds_of_that_stage_only(pair: Pair) -> None:
    names = [object_name(0, 1, "delta"), object_name(0, 2, "delta", 1), object_name(0, 3, "claim")]
    names.append(object_name(1, 1, "delta"))
    for name in names:
        await pair.a.store.publish(name, b"x" * 10)
    await pair.a.store.retire(0, 3)
    assert sorted(pair.a.shelf._objects) == [object_name(0, 3, "claim"), object_name(1, 1, "delta")]
    assert pair.a.shelf.total_bytes == 20
    assert await pair.b.store.fetch(_a(pair), names[0], max_bytes=10) is None
    assert await pair.b.store.fetch(_a(pair), names[2], max_bytes=10) == b"x" * 10


def test_shelf_bounds_refuse_and_change_nothing() -> None:
    shelf = ObjectShelf(max_bytes=100, max_objects=2)
    shelf.put("0/1/a", b"x" * 60)
    with pytest.raises(ShelfFull, match=r"110 bytes \(max 100\)"):
        shelf.put("0/1/b", b"y" * 50)
    shelf.put("0/1/a", b"z" * 90)  # a replacement counts its new size only
    shelf.put("0/1/b", b"w" * 10)
    with pytest.raises(ShelfFull, match=r"2 objects \(max 2\)"):
        shelf.put("0/1/c", b"")
    assert (len(shelf), shelf.total_bytes, shelf.get("0/1/a")) == (2, 100, b"z" * 90)
    with pytest.raises(ValueError, match="object name"):
        shelf.put("0/1/A", b"")


@pytest.mark.asyncio
async def test_close_wakes_waiting_readers() -> None:
    shelf = ObjectShelf(max_bytes=100, max_objects=2)
    waiter = asyncio.create_task(shelf.wait(NAME, 30.0))
    await asyncio.sleep(0.05)
    shelf.close()
    assert await asyncio.wait_for(waiter, 1.0) is None


@pytest.mark.asyncio
async def test_traffic_counts_bodies_and_heads_on_both_sides(pair: Pair) -> None:
    await pair.a.store.publish(NAME, DELTA)
    span = (1000, 5096)
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=len(DELTA)) == DELTA
    assert await pair.b.store.fetch(_a(pair), NAME, max_bytes=4096, span=span) is not None
    mine, client, served = pair.b.store.traffic, pair.b.client.traffic, pair.a.shelf.served
    bodies = len(DELTA) + 4096
    assert mine.requests == client.requests == served.requests == 2
    assert bodies < mine.bytes_received < bodies + 1000
    assert mine.bytes_received == client.bytes_received  # same heads as the client counts
    assert 0 < client.bytes_sent - mine.bytes_sent < 200  # aiohttp's default headers left out
    assert bodies < served.bytes_sent < bodies + 1000
    assert served.bytes_received > 0
    # The middleware counted the same answers in the server's traffic (only this route was hit).
    assert dataclasses.astuple(pair.a.node.traffic) == dataclasses.astuple(served)


@pytest.mark.asyncio
async def test_server_shutdown_answers_pending_long_polls(make_node, wallets) -> None:
    replica = await _replica(make_node(wallets[0]), wallets[0], lambda wallet: None, poll_s=30.0)
    path = object_path(NAME, 20.0)
    try:
        async with ClientSession() as session:

            async def get() -> int:
                auth = sign_request(wallets[1], "GET", path, b"", time.time())
                async with session.get(replica.server.make_url(path), headers=auth) as r:
                    return r.status

            poll = asyncio.create_task(get())
            await asyncio.sleep(0.2)
            started = time.monotonic()
            await replica.server.close()
            assert time.monotonic() - started < 5.0  # not held up by the 20 s poll
            assert await asyncio.wait_for(poll, 5.0) == 404
    finally:
        await replica.client.close()
        await replica.server.close()
