"""Property: the peer server answers every generated request with a 2xx or a 4xx, never a 5xx,
and a refused request changes nothing (peer table, snapshot, nonces).

A real aiohttp server on loopback (node.p2p.server with the object route). Three kinds of
input: signed POST /p2p/announce bodies (any bytes, any JSON, a valid record with one field
broken or duplicated), signed headers with one value broken (wallet, timestamp, nonce,
signature: any text), and GETs of the object route with any name, Range and wait."""

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import ClientSession, test_utils
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from neuroshard.node.p2p.objects import ObjectRoutes, ObjectShelf
from neuroshard.node.p2p.peers import PeerTable
from neuroshard.node.p2p.server import NodeState, ServerLimits, build_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import ANNOUNCE, PEERS, STATUS, PeerRecord
from neuroshard.protocol.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
    NonceCache,
    sign_request,
)

EXAMPLES = 150
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
NODE = Wallet.from_token("fuzz-http-node")
SENDER = Wallet.from_token("fuzz-http-sender")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140
)  # what an HTTP header can carry


@dataclass
class Peer:
    loop: asyncio.AbstractEventLoop
    node: NodeState
    server: test_utils.TestServer
    session: ClientSession

    def send(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> int:
        async def go() -> int:
            async with self.session.request(
                method, self.server.make_url(path), data=body or None, headers=headers or {}
            ) as r:
                await r.read()
                return r.status

        return self.loop.run_until_complete(go())

    def signed(self, method: str, path: str, body: bytes = b"", **override: str) -> int:
        headers = sign_request(SENDER, method, path, body, time.time())
        headers.update(override)
        return self.send(method, path, body, headers)

    def fingerprint(self) -> tuple[Any, ...]:
        records = sorted((r.wallet, r.address, r.last_seen) for r in self.node.peers.records(time.time()))
        return (records, self.node.snapshot, self.node.status)


@pytest.fixture
def peer() -> Iterator[Peer]:
    loop = asyncio.new_event_loop()
    node = NodeState(
        wallet=NODE,
        stage=0,
        peers=PeerTable(own_wallet=NODE.public_key_hex, ttl_s=300.0, ban_after=3, ban_s=30.0),
        nonces=NonceCache(60.0),
        clock=time.time,
        limits=ServerLimits(),
        log=lambda line: None,
    )
    shelf = ObjectShelf(max_bytes=1 << 20, max_objects=16)
    server = test_utils.TestServer(
        build_app(node, window_s=60.0, extensions=[ObjectRoutes(shelf, max_wait_s=0.01)]), host="127.0.0.1"
    )
    try:
        session = loop.run_until_complete(_start(shelf, server))
        try:
            yield Peer(loop, node, server, session)
        finally:
            loop.run_until_complete(session.close())
            loop.run_until_complete(server.close())
    finally:
        loop.close()


async def _start(shelf: ObjectShelf, server: test_utils.TestServer) -> ClientSession:
    shelf.put("commit", b"x" * 1000)  # an object to fetch ranges of
    await server.start_server()
    return ClientSession()


def _outcome(tally: Any, decoder: str, status: int) -> None:
    tally.add(decoder, status)
    assert status < 500, (decoder, status)


def _valid_record() -> dict[str, Any]:
    return PeerRecord.create(SENDER, address="127.0.0.1:7001", stage=0, last_seen=time.time()).to_obj()


def test_announce_bodies(peer: Peer, tally: Any) -> None:
    record = _valid_record()

    @FUZZ
    @given(
        body=st.one_of(
            st.binary(max_size=400),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.tuples(st.sampled_from(sorted(record)), json_values).map(
                lambda kv: json.dumps({**record, kv[0]: kv[1]}).encode()
            ),
            st.tuples(st.sampled_from(sorted(record)), json_values).map(
                lambda kv: (
                    json.dumps(record)[:-1] + f", {json.dumps(kv[0])}: {json.dumps(kv[1])}}}"
                ).encode()
            ),
            st.integers(min_value=500, max_value=2000).map(lambda n: b"[" * n + b"]" * n),
        )
    )
    def run(body: bytes) -> None:
        before = peer.fingerprint()
        status = peer.signed("POST", ANNOUNCE, body)
        _outcome(tally, "peer POST /p2p/announce body", status)
        if status >= 400:
            assert peer.fingerprint() == before

    run()


HEADERS = [WALLET_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER]


def test_signed_headers(peer: Peer, tally: Any) -> None:
    body = json.dumps(_valid_record()).encode()

    @FUZZ
    @given(
        header=st.sampled_from(HEADERS),
        value=st.one_of(
            header_text,
            st.text("0123456789abcdef", min_size=0, max_size=140),
            st.integers(min_value=0, max_value=10**20).map(str),
        ),
        path=st.sampled_from([ANNOUNCE, STATUS, PEERS]),
    )
    def run(header: str, value: str, path: str) -> None:
        before, nonces = peer.fingerprint(), len(peer.node.nonces)
        method = "POST" if path == ANNOUNCE else "GET"
        status = peer.signed(method, path, body if method == "POST" else b"", **{header: value})
        _outcome(tally, "peer signed headers", status)
        if status >= 400:
            assert peer.fingerprint() == before and len(peer.node.nonces) == nonces

    run()


def test_object_route_queries(peer: Peer, tally: Any) -> None:
    @FUZZ
    @given(
        name=st.one_of(
            st.sampled_from(["commit", "claim/0", "digest"]), st.text("abc/_-.%0123", max_size=40)
        ),
        range_=st.none() | header_text | st.integers(0, 2000).map(lambda a: f"bytes={a}-{a // 2}"),
        wait=st.none() | st.sampled_from(["nan", "inf", "-1", "1e999", "0.001", "x"]) | header_text,
    )
    def run(name: str, range_: str | None, wait: str | None) -> None:
        path = (
            "/p2p/obj/"
            + name
            + ("" if wait is None else "?" + "wait=" + wait.replace("&", "").replace("#", ""))
        )
        headers = sign_request(SENDER, "GET", path, b"", time.time())
        if range_ is not None:
            headers["Range"] = range_
        status = peer.send("GET", path, b"", headers)
        _outcome(tally, "peer GET /p2p/obj/{name}", status)

    run()
