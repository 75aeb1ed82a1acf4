"""The peer server under attack: every bad request gets the right 4xx and changes nothing.

An in-process aiohttp server on loopback; requests are built by hand (signed with the
real signing code, then broken on purpose) so each test controls exactly what is wrong.
The signed-request checks are exercised on POST /p2p/announce, the one route of the server
with a body; the outer round's object route has its own tests (test_objects.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession, test_utils

from neuroshard.node.codec import decode_state
from neuroshard.node.p2p.server import NodeState, build_app
from neuroshard.node.wallet import Wallet
from neuroshard.protocol.peer import (
    ANNOUNCE,
    PEERS,
    STATE,
    STATE_HEADER,
    STATUS,
    ErrorReply,
    PeerList,
    PeerRecord,
    StateInfo,
)
from neuroshard.protocol.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WALLET_HEADER,
    sign_request,
)


@dataclass
class Served:
    node: NodeState
    server: test_utils.TestServer
    session: ClientSession

    async def send(
        self,
        wallet: Wallet,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        *,
        now: float | None = None,
        signed_body: bytes | None = None,
        auth: dict[str, str] | None = None,
    ) -> tuple[int, Any, bytes]:
        """Sign (over `signed_body` if given, to forge a mismatch), send `body`, return (status, headers, body)."""
        signed = sign_request(
            wallet, method, path, body if signed_body is None else signed_body, now or time.time()
        )
        all_headers = {**(headers or {}), **(signed if auth is None else auth)}
        async with self.session.request(
            method, self.server.make_url(path), data=body or None, headers=all_headers
        ) as r:
            return r.status, r.headers, await r.read()

    async def announce(self, wallet: Wallet, body: bytes, **kw: Any) -> tuple[int, str]:
        status, _, reply = await self.send(wallet, "POST", ANNOUNCE, body, **kw)
        return status, _error(status, reply)


def _record(wallet: Wallet, port: int = 7001) -> PeerRecord:
    return PeerRecord.create(wallet, address=f"127.0.0.1:{port}", stage=0, last_seen=time.time())


def _error(status: int, body: bytes) -> str:
    if status < 400:
        return ""
    reply = ErrorReply.from_json(body)  # every refusal is the JSON error shape
    return f"{reply.error}: {reply.detail}"


def _fingerprint(node: NodeState) -> tuple[Any, ...]:
    """The node's application state: what a refused request must not change."""
    return (sorted(r.wallet for r in node.peers.records(node.clock())), node.snapshot, node.status)


@pytest_asyncio.fixture
async def served(make_node, wallets) -> AsyncIterator[Served]:  # type: ignore[no-untyped-def]
    node = make_node(wallets[0])
    server = test_utils.TestServer(build_app(node, window_s=60.0), host="127.0.0.1")
    await server.start_server()
    async with ClientSession() as session:
        yield Served(node, server, session)
    await server.close()


@pytest.mark.asyncio
async def test_forged_request_signature_is_401(served, wallets) -> None:
    body = _record(wallets[1]).to_json()
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    # Signed by wallet 2 but claiming to be wallet 1.
    auth = sign_request(wallets[2], "POST", ANNOUNCE, body, time.time())
    auth[WALLET_HEADER] = wallets[1].public_key_hex
    status, reason = await served.announce(wallets[1], body, auth=auth)
    assert status == 401 and "bad_signature" in reason
    # Signed over other bytes than those sent (a relay changed the body).
    other = _record(wallets[1], port=7999).to_json()
    status, reason = await served.announce(wallets[1], body, signed_body=other)
    assert status == 401 and "bad_signature" in reason
    # Signed for another path.
    auth = sign_request(wallets[1], "POST", PEERS, body, time.time())
    assert (await served.announce(wallets[1], body, auth=auth))[0] == 401
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("drop", "replace", "message"),
    [
        (SIGNATURE_HEADER, None, "missing auth header"),
        (NONCE_HEADER, None, "missing auth header"),
        (None, (TIMESTAMP_HEADER, "12.5"), "integer milliseconds"),
        (None, (NONCE_HEADER, "zz" * 16), "lowercase hex"),
        (None, (WALLET_HEADER, "AB" * 32), "64 lowercase hex"),
    ],
)
async def test_missing_or_malformed_auth_headers_are_401(served, wallets, drop, replace, message) -> None:
    auth = sign_request(wallets[1], "GET", STATUS, b"", time.time())
    if drop:
        del auth[drop]
    if replace:
        auth[replace[0]] = replace[1]
    status, _, body = await served.send(wallets[1], "GET", STATUS, auth=auth)
    assert status == 401 and message in _error(status, body)


@pytest.mark.asyncio
async def test_replayed_nonce_is_409_and_changes_nothing(served, wallets) -> None:
    body = _record(wallets[1]).to_json()
    auth = sign_request(wallets[1], "POST", ANNOUNCE, body, time.time())
    assert (await served.announce(wallets[1], body, auth=auth))[0] == 204
    after_first = _fingerprint(served.node)
    status, reason = await served.announce(wallets[1], body, auth=dict(auth))
    assert status == 409 and reason.startswith("replay")
    assert _fingerprint(served.node) == after_first


@pytest.mark.asyncio
@pytest.mark.parametrize("offset", [-61.0, 61.0, -3600.0])
async def test_stale_timestamp_is_401(served, wallets, offset) -> None:
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    status, reason = await served.announce(
        wallets[1], _record(wallets[1]).to_json(), now=time.time() + offset
    )
    assert status == 401 and reason.startswith("stale")
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces


@pytest.mark.asyncio
async def test_timestamp_inside_the_window_is_fine(served, wallets) -> None:
    status, _, body = await served.send(wallets[1], "GET", STATUS, now=time.time() - 50)
    assert status == 200 and StateInfo.from_json(body).signature_valid()


@pytest.mark.asyncio
async def test_oversized_body_is_413_before_it_is_read(served, wallets) -> None:
    limit = served.node.body_limit("announce")
    big = b" " * (limit + 1)
    before = _fingerprint(served.node)
    status, reason = await served.announce(wallets[1], big)
    assert status == 413 and reason.startswith("too_large")

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(limit // 1024 + 2):
            yield b" " * 1024

    # Chunked, no Content-Length: the server stops reading at the limit.
    auth = sign_request(wallets[1], "POST", ANNOUNCE, big, time.time())
    async with served.session.post(served.server.make_url(ANNOUNCE), data=chunks(), headers=auth) as r:
        assert r.status == 413
    # A GET route takes no body at all.
    status, _, _ = await served.send(wallets[1], "GET", STATUS, b"x")
    assert status == 413
    assert _fingerprint(served.node) == before


@pytest.mark.asyncio
async def test_malformed_record_is_400_or_422(served, wallets) -> None:
    obj = json.loads(_record(wallets[1]).to_json())
    before = _fingerprint(served.node)
    cases = [
        (b"{not json", 400, "not JSON"),
        (json.dumps({**obj, "extra": 1}).encode(), 400, "unknown field"),
        (json.dumps({k: v for k, v in obj.items() if k != "stage"}).encode(), 400, "missing field"),
        (json.dumps({**obj, "stage": -1}).encode(), 422, "outside"),
        (json.dumps({**obj, "address": "nohost"}).encode(), 422, "not host:port"),
        (b"[" * 2000 + b"]" * 2000, 400, "nests too deep"),  # was a 500 with a traceback
    ]
    for body, expected, text in cases:
        status, reason = await served.announce(wallets[1], body)
        assert status == expected and text in reason, (status, reason)
    assert _fingerprint(served.node) == before


@pytest.mark.asyncio
async def test_unknown_route_and_method_are_404_405(served, wallets) -> None:
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    # The old all-to-all exchange's routes are gone with it.
    for path in ("/p2p/nope", "/", "/p2p/contribution/3", "/p2p/reveal/3/" + "ab" * 32):
        status, _, body = await served.send(wallets[1], "GET", path)
        assert status == 404 and _error(status, body).startswith("unknown_route")
    for path in ("/p2p/digest", "/p2p/contribution", "/p2p/reveal"):
        status, _, body = await served.send(wallets[1], "POST", path, b"{}")
        assert status == 404 and _error(status, body).startswith("unknown_route")
    status, _, body = await served.send(wallets[1], "DELETE", STATUS)
    assert status == 405 and _error(status, body).startswith("method_not_allowed")
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces


@pytest.mark.asyncio
async def test_announce_takes_only_the_senders_own_valid_record(served, wallets) -> None:
    own = _record(wallets[1])
    other = _record(wallets[2], port=7002)
    status, reason = await served.announce(wallets[1], other.to_json())
    assert status == 422 and "not_own" in reason
    forged = PeerRecord.from_obj({**json.loads(own.to_json()), "address": "6.6.6.6:1"})
    status, reason = await served.announce(wallets[1], forged.to_json())
    assert status == 422 and "bad_record_signature" in reason
    assert len(served.node.peers) == 0
    assert await served.announce(wallets[1], own.to_json()) == (204, "")
    served.node.announced = True
    status, _, body = await served.send(wallets[2], "GET", PEERS)
    listed = PeerList.from_json(body)
    assert {r.wallet for r in listed.peers} == {wallets[0].public_key_hex, wallets[1].public_key_hex}
    assert all(r.signature_valid() for r in listed.peers)


@pytest.mark.asyncio
async def test_state_download_matches_the_signed_status(served, wallets) -> None:
    status, _, body = await served.send(wallets[1], "GET", STATUS)
    info = StateInfo.from_json(body)
    status, headers, body = await served.send(wallets[1], "GET", STATE)
    assert status == 200 and StateInfo.from_json(headers[STATE_HEADER]) == info
    theta, momentum = decode_state(body, info.numel, with_momentum=False)
    assert momentum is None
    assert hashlib.sha256(theta.numpy().astype("<f4").tobytes()).hexdigest() == info.theta_hash


@pytest.mark.asyncio
async def test_client_gone_mid_upload_changes_nothing(served, wallets) -> None:
    body = _record(wallets[1]).to_json()
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    auth = sign_request(wallets[1], "POST", ANNOUNCE, body, time.time())
    lines = [
        f"POST {ANNOUNCE} HTTP/1.1",
        f"Host: {served.server.host}",
        f"Content-Length: {len(body)}",
        *(f"{k}: {v}" for k, v in auth.items()),
    ]
    _, writer = await asyncio.open_connection(served.server.host, served.server.port)
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body[: len(body) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.2)
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces
    assert await served.announce(wallets[1], body) == (204, "")  # the same upload, complete, is taken
    assert _fingerprint(served.node) != before
