"""The peer server under attack: every bad request gets the right 4xx and changes nothing.

An in-process aiohttp server on loopback; requests are built by hand (signed with the
real signing code, then broken on purpose) so each test controls exactly what is wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import pickle
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import torch
from aiohttp import ClientSession, test_utils
from safetensors.torch import save as st_save

from neuroshard.node.p2p import wire
from neuroshard.node.p2p.auth import sign_request
from neuroshard.node.p2p.codec import decode_state, encode_delta, sha256_hex
from neuroshard.node.p2p.server import NodeState, build_app
from neuroshard.node.p2p.wire import (
    Commitment,
    ContributionHeader,
    Digest,
    ErrorReply,
    PeerList,
    PeerRecord,
    Reveal,
    StateInfo,
)
from neuroshard.node.wallet import Wallet

NUMEL, ROUND = 1000, 3


@dataclass
class Served:
    node: NodeState
    server: test_utils.TestServer
    session: ClientSession
    wallets: list[Wallet]

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

    async def reveal(self, header: ContributionHeader, **kw: Any) -> tuple[int, str]:
        """POST the contributor's reveal of `header` (listing only itself), sent by the contributor."""
        status, _, body = await self.send(
            self.signer(header.wallet),
            "POST",
            wire.REVEAL,
            _reveal(self.signer(header.wallet), header).to_json(),
            **kw,
        )
        return status, _error(status, body)

    def signer(self, wallet_hex: str) -> Wallet:
        return next(w for w in self.wallets if w.public_key_hex == wallet_hex)

    async def push(
        self, wallet: Wallet, header: ContributionHeader, payload: bytes, *, reveal: bool = True, **kw: Any
    ) -> tuple[int, str]:
        """Reveal (unless `reveal` is False), then push the payload; the first refusal is returned."""
        if reveal:
            revealed = await self.reveal(header)
            if revealed[0] != 204:
                return revealed
        status, _, body = await self.send(
            wallet,
            "POST",
            wire.CONTRIBUTION,
            payload,
            {wire.CONTRIBUTION_HEADER: header.to_json().decode()},
            **kw,
        )
        return status, _error(status, body)


def _reveal(signer: Wallet, header: ContributionHeader, *others: ContributionHeader) -> Reveal:
    listed = sorted((h.wallet, h.payload_sha256) for h in (header, *others))
    return Reveal.create(
        signer, contribution=header, held=tuple(Commitment(wallet=w, payload_sha256=p) for w, p in listed)
    )


def _error(status: int, body: bytes) -> str:
    if status < 400:
        return ""
    reply = ErrorReply.from_json(body)  # every refusal is the JSON error shape
    return f"{reply.error}: {reply.detail}"


def _fingerprint(node: NodeState) -> tuple[Any, ...]:
    """The node's application state: what a refused request must not change."""
    book = node.books[ROUND]
    return (
        sorted(book.accepted),
        sorted(book.rejected),
        sorted(book.equivocators),
        sorted(node.books),
        len(node.peers),
        node.snapshot,
    )


@pytest_asyncio.fixture
async def served(make_node, wallets) -> AsyncIterator[Served]:  # type: ignore[no-untyped-def]
    node = make_node(wallets[0])
    server = test_utils.TestServer(build_app(node, window_s=60.0), host="127.0.0.1")
    await server.start_server()
    async with ClientSession() as session:
        yield Served(node, server, session, wallets)
    await server.close()


@pytest.mark.asyncio
async def test_valid_contribution_is_accepted_once(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1])
    assert await served.push(wallets[1], header, payload) == (204, "")
    assert await served.push(wallets[1], header, payload) == (204, "")  # idempotent
    assert list(served.node.books[ROUND].accepted) == [wallets[1].public_key_hex]
    # A wallet that committed to the round may pull it back, byte for byte, with the signed header
    # and the reveal (test_payloads_are_revealed_to_committed_wallets_only: the others may not).
    served.node.commit(make_contribution(wallets[2], seed=5)[0])
    path = wire.CONTRIBUTION_PULL.format(round=ROUND, wallet=wallets[1].public_key_hex)
    status, headers, body = await served.send(wallets[2], "GET", path)
    assert status == 200 and body == payload
    assert ContributionHeader.from_json(headers[wire.CONTRIBUTION_HEADER]) == header
    path = wire.REVEAL_PULL.format(round=ROUND, wallet=wallets[1].public_key_hex)
    status, _, body = await served.send(wallets[2], "GET", path)
    assert status == 200 and Reveal.from_json(body) == _reveal(wallets[1], header)


@pytest.mark.asyncio
async def test_forged_request_signature_is_401(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1])
    assert await served.reveal(header) == (204, "")
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    # Signed by wallet 2 but claiming to be wallet 1.
    auth = sign_request(wallets[2], "POST", wire.CONTRIBUTION, payload, time.time())
    auth[wire.WALLET_HEADER] = wallets[1].public_key_hex
    status, reason = await served.push(wallets[1], header, payload, auth=auth, reveal=False)
    assert status == 401 and "bad_signature" in reason
    # Signed over other bytes than those sent (a relay changed the body).
    other = encode_delta(torch.ones(NUMEL), "int8")
    status, reason = await served.push(wallets[1], header, payload, signed_body=other, reveal=False)
    assert status == 401 and "bad_signature" in reason
    # Signed for another path.
    auth = sign_request(wallets[1], "POST", wire.DIGEST, payload, time.time())
    assert (await served.push(wallets[1], header, payload, auth=auth, reveal=False))[0] == 401
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("drop", "replace", "message"),
    [
        (wire.SIGNATURE_HEADER, None, "missing auth header"),
        (wire.NONCE_HEADER, None, "missing auth header"),
        (None, (wire.TIMESTAMP_HEADER, "12.5"), "integer milliseconds"),
        (None, (wire.NONCE_HEADER, "zz" * 16), "lowercase hex"),
        (None, (wire.WALLET_HEADER, "AB" * 32), "64 lowercase hex"),
    ],
)
async def test_missing_or_malformed_auth_headers_are_401(served, wallets, drop, replace, message) -> None:
    auth = sign_request(wallets[1], "GET", wire.STATUS, b"", time.time())
    if drop:
        del auth[drop]
    if replace:
        auth[replace[0]] = replace[1]
    status, _, body = await served.send(wallets[1], "GET", wire.STATUS, auth=auth)
    assert status == 401 and message in _error(status, body)


@pytest.mark.asyncio
async def test_replayed_nonce_is_409_and_changes_nothing(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1])
    auth = sign_request(wallets[1], "POST", wire.CONTRIBUTION, payload, time.time())
    assert (await served.push(wallets[1], header, payload, auth=auth))[0] == 204
    after_first = _fingerprint(served.node)
    status, reason = await served.push(wallets[1], header, payload, auth=dict(auth))
    assert status == 409 and reason.startswith("replay")
    assert _fingerprint(served.node) == after_first


@pytest.mark.asyncio
@pytest.mark.parametrize("offset", [-61.0, 61.0, -3600.0])
async def test_stale_timestamp_is_401(served, wallets, make_contribution, offset) -> None:
    header, payload = make_contribution(wallets[1])
    assert await served.reveal(header) == (204, "")
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    status, reason = await served.push(wallets[1], header, payload, now=time.time() + offset, reveal=False)
    assert status == 401 and reason.startswith("stale")
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces


@pytest.mark.asyncio
async def test_timestamp_inside_the_window_is_fine(served, wallets) -> None:
    status, _, body = await served.send(wallets[1], "GET", wire.STATUS, now=time.time() - 50)
    assert status == 200 and StateInfo.from_json(body).signature_valid()


@pytest.mark.asyncio
async def test_wrong_stage_or_round_is_refused(served, wallets, make_contribution) -> None:
    before = _fingerprint(served.node)
    header, payload = make_contribution(wallets[1], stage=1)
    status, reason = await served.push(wallets[1], header, payload)
    assert status == 422 and reason.startswith("wrong_stage")
    for round_ in (ROUND + 1, ROUND - 1, 10**6):
        header, payload = make_contribution(wallets[1], round_=round_)
        status, reason = await served.push(wallets[1], header, payload)
        assert status == 409 and reason.startswith("wrong_round") and "at round 3" in reason
    assert _fingerprint(served.node) == before


@pytest.mark.asyncio
async def test_wrong_base_hash_is_422_and_recorded_not_stored(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1], base_hash="cd" * 32)
    status, reason = await served.push(wallets[1], header, payload)
    assert status == 422 and "base_hash cdcdcdcd" in reason
    book = served.node.books[ROUND]
    assert book.accepted == {} and list(book.rejected) == [wallets[1].public_key_hex]


@pytest.mark.asyncio
async def test_oversized_body_is_413_before_it_is_read(served, wallets, make_contribution) -> None:
    limit = served.node.body_limit("contribution_push")
    big = b"\0" * (limit + 1)
    header, _ = make_contribution(wallets[1])
    before = _fingerprint(served.node)
    status, reason = await served.push(wallets[1], header, big)
    assert status == 413 and reason.startswith("too_large")

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(limit // 4096 + 2):
            yield b"\0" * 4096

    # Chunked, no Content-Length: the server stops reading at the limit.
    auth = sign_request(wallets[1], "POST", wire.CONTRIBUTION, big, time.time())
    headers = {**auth, wire.CONTRIBUTION_HEADER: header.to_json().decode()}
    async with served.session.post(
        served.server.make_url(wire.CONTRIBUTION), data=chunks(), headers=headers
    ) as r:
        assert r.status == 413
    # A GET route takes no body at all.
    status, _, _ = await served.send(wallets[1], "GET", wire.STATUS, b"x")
    assert status == 413
    assert _fingerprint(served.node) == before


@pytest.mark.asyncio
async def test_truncated_safetensors_is_400(served, wallets, make_contribution) -> None:
    _, full = make_contribution(wallets[1])
    before = _fingerprint(served.node)
    for wallet, cut in zip(wallets[1:], (4, 50, len(full) - 7), strict=True):
        # Validly signed over the truncated bytes: the decoder, not the hash, must catch it.
        header, payload = make_contribution(wallet, payload=full[:cut])
        status, reason = await served.push(wallet, header, payload)
        assert status == 400 and reason.startswith("malformed"), reason
    assert served.node.books[ROUND].accepted == {}
    assert _fingerprint(served.node)[0] == before[0]


@pytest.mark.asyncio
async def test_nan_payload_is_422(served, wallets, make_contribution) -> None:
    delta = torch.zeros(NUMEL, dtype=torch.float16)
    delta[10] = float("nan")
    header, payload = make_contribution(wallets[1], payload=st_save({"delta": delta}), encoding="fp16")
    status, reason = await served.push(wallets[1], header, payload)
    assert status == 422 and "non-finite" in reason
    book = served.node.books[ROUND]
    assert book.accepted == {}
    assert "non-finite" in book.rejected[wallets[1].public_key_hex].reason  # signed, so it is evidence


@pytest.mark.asyncio
async def test_pickle_payload_is_400(served, wallets, make_contribution) -> None:
    buffer = io.BytesIO()
    torch.save({"delta": torch.zeros(100)}, buffer)  # small enough to pass the size limit
    before = _fingerprint(served.node)
    for wallet, blob in zip(wallets[1:], (buffer.getvalue(), pickle.dumps(torch.zeros(100))), strict=False):
        header, payload = make_contribution(wallet, payload=blob, encoding="fp16")
        status, reason = await served.push(wallet, header, payload)
        assert status == 400 and "not a safetensors file" in reason
    assert _fingerprint(served.node)[0] == before[0]


@pytest.mark.asyncio
async def test_payload_not_matching_its_signed_hash_is_422(served, wallets, make_contribution) -> None:
    header, _ = make_contribution(wallets[1])
    _, other = make_contribution(wallets[1], seed=9)
    before = _fingerprint(served.node)
    status, reason = await served.push(wallets[1], header, other)
    assert status == 422 and reason.startswith("payload_mismatch")
    assert _fingerprint(served.node) == before  # not recorded: the signature does not cover these bytes


@pytest.mark.asyncio
async def test_malformed_contribution_header_is_400_or_422(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1])
    before = _fingerprint(served.node)
    obj = json.loads(header.to_json())
    cases = [
        ({**obj, "extra": 1}, 400, "unknown field"),
        ({k: v for k, v in obj.items() if k != "tokens"}, 400, "missing field"),
        ({**obj, "encoding": "pickle"}, 422, "not one of"),
        ({**obj, "tokens": -5}, 422, "outside"),
    ]
    for raw, expected, text in cases:
        status, _, body = await served.send(
            wallets[1], "POST", wire.CONTRIBUTION, payload, {wire.CONTRIBUTION_HEADER: json.dumps(raw)}
        )
        assert status == expected and text in _error(status, body)
    status, _, body = await served.send(wallets[1], "POST", wire.CONTRIBUTION, payload)
    assert status == 400 and "missing X-NeuroShard-Contribution" in _error(status, body)
    # A header whose contributor signature fails (someone else's name on it).
    forged = ContributionHeader.from_obj({**obj, "wallet": wallets[2].public_key_hex})
    status, reason = await served.push(wallets[1], forged, payload)
    assert status == 422 and reason.startswith("bad_contribution_signature")
    assert _fingerprint(served.node) == before


@pytest.mark.asyncio
async def test_unknown_route_and_method_are_404_405(served, wallets) -> None:
    before, nonces = _fingerprint(served.node), len(served.node.nonces)
    for path in ("/p2p/nope", "/", "/p2p/contribution/3"):
        status, _, body = await served.send(wallets[1], "GET", path)
        assert status == 404 and _error(status, body).startswith("unknown_route")
    status, _, body = await served.send(wallets[1], "DELETE", wire.STATUS)
    assert status == 405 and _error(status, body).startswith("method_not_allowed")
    assert _fingerprint(served.node) == before and len(served.node.nonces) == nonces


@pytest.mark.asyncio
async def test_equivocation_excludes_the_wallet(served, wallets, make_contribution) -> None:
    first = make_contribution(wallets[1], seed=1)
    second = make_contribution(wallets[1], seed=2)
    assert (await served.push(wallets[1], *first))[0] == 204
    status, reason = await served.push(wallets[1], *second)
    assert status == 409 and reason.startswith("equivocation")
    book = served.node.books[ROUND]
    w = wallets[1].public_key_hex
    assert w not in book.accepted and book.equivocators[w] == (first[0], second[0])
    assert (await served.push(wallets[1], *first))[0] == 409  # stays excluded
    # The digest carries both signed headers: the proof travels to other replicas.
    digest = served.node.digest(ROUND)
    assert {h.payload_sha256 for h in digest.entries} == {first[0].payload_sha256, second[0].payload_sha256}


@pytest.mark.asyncio
async def test_digest_swap_reveals_missing_contributions_and_equivocation(
    served, wallets, make_contribution
) -> None:
    held, payload = make_contribution(wallets[1], seed=1)
    assert (await served.push(wallets[1], held, payload))[0] == 204
    other, _ = make_contribution(wallets[1], seed=2)  # wallet 1 signed something else for wallet 3
    news, _ = make_contribution(wallets[2], seed=3)
    digest = Digest.create(
        wallets[3],
        stage=0,
        round=ROUND,
        current_round=ROUND,
        current_hash="ab" * 32,
        closed=False,
        aggregated=(),
        entries=(other, news),
    )
    status, _, body = await served.send(wallets[3], "POST", wire.DIGEST, digest.to_json())
    assert status == 200
    reply = Digest.from_json(body)
    assert reply.wallet == wallets[0].public_key_hex and reply.signature_valid()
    book = served.node.books[ROUND]
    assert wallets[1].public_key_hex in book.equivocators
    assert list(book.wanted) == [wallets[2].public_key_hex]
    assert book.sources[wallets[2].public_key_hex] == {wallets[3].public_key_hex}
    # A digest must come from its own signer.
    status, _, body = await served.send(wallets[2], "POST", wire.DIGEST, digest.to_json())
    assert status == 422 and "not_own" in _error(status, body)


@pytest.mark.asyncio
async def test_announce_takes_only_the_senders_own_valid_record(served, wallets) -> None:
    own = PeerRecord.create(wallets[1], address="127.0.0.1:7001", stage=0, last_seen=time.time())
    other = PeerRecord.create(wallets[2], address="127.0.0.1:7002", stage=0, last_seen=time.time())
    status, _, body = await served.send(wallets[1], "POST", wire.ANNOUNCE, other.to_json())
    assert status == 422 and "not_own" in _error(status, body)
    forged = PeerRecord.from_obj({**json.loads(own.to_json()), "address": "6.6.6.6:1"})
    status, _, body = await served.send(wallets[1], "POST", wire.ANNOUNCE, forged.to_json())
    assert status == 422 and "bad_record_signature" in _error(status, body)
    assert len(served.node.peers) == 0
    status, _, _ = await served.send(wallets[1], "POST", wire.ANNOUNCE, own.to_json())
    assert status == 204
    served.node.announced = True
    status, _, body = await served.send(wallets[2], "GET", wire.PEERS)
    listed = PeerList.from_json(body)
    assert {r.wallet for r in listed.peers} == {wallets[0].public_key_hex, wallets[1].public_key_hex}
    assert all(r.signature_valid() for r in listed.peers)


@pytest.mark.asyncio
async def test_state_download_matches_the_signed_status(served, wallets) -> None:
    status, _, body = await served.send(wallets[1], "GET", wire.STATUS)
    info = StateInfo.from_json(body)
    status, headers, body = await served.send(wallets[1], "GET", wire.STATE)
    assert status == 200 and StateInfo.from_json(headers[wire.STATE_HEADER]) == info
    theta, momentum = decode_state(body, info.numel, with_momentum=False)
    assert momentum is None
    assert hashlib.sha256(theta.numpy().astype("<f4").tobytes()).hexdigest() == info.theta_hash


@pytest.mark.asyncio
async def test_client_gone_mid_upload_changes_nothing(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1])
    assert await served.reveal(header) == (204, "")
    before = _fingerprint(served.node)
    auth = sign_request(wallets[1], "POST", wire.CONTRIBUTION, payload, time.time())
    lines = [
        f"POST {wire.CONTRIBUTION} HTTP/1.1",
        f"Host: {served.server.host}",
        f"Content-Length: {len(payload)}",
        f"{wire.CONTRIBUTION_HEADER}: {header.to_json().decode()}",
        *(f"{k}: {v}" for k, v in auth.items()),
    ]
    _, writer = await asyncio.open_connection(served.server.host, served.server.port)
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload[: len(payload) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(0.2)
    assert _fingerprint(served.node) == before
    assert sha256_hex(payload) == header.payload_sha256  # the same upload, complete, is accepted
    assert (await served.push(wallets[1], header, payload))[0] == 204


@pytest.mark.asyncio
async def test_payload_before_its_reveal_is_409_and_changes_nothing(
    served, wallets, make_contribution
) -> None:
    header, payload = make_contribution(wallets[1])
    book = served.node.books[ROUND]
    before = (_fingerprint(served.node), dict(book.committed), dict(book.reveals))
    status, reason = await served.push(wallets[1], header, payload, reveal=False)
    assert status == 409 and reason.startswith("not_revealed")
    # A reveal of another contribution of the same wallet does not open the door either.
    other, _ = make_contribution(wallets[2], seed=4)
    assert await served.reveal(other) == (204, "")
    status, reason = await served.push(wallets[2], header, payload, reveal=False)
    assert status == 409 and reason.startswith("not_revealed")
    assert (_fingerprint(served.node), dict(book.committed)) == (
        before[0],
        {**before[1], other.wallet: other},
    )


@pytest.mark.asyncio
async def test_bad_reveals_are_refused_and_change_nothing(served, wallets, make_contribution) -> None:
    header, _ = make_contribution(wallets[1])
    book = served.node.books[ROUND]

    def state() -> tuple[Any, ...]:
        return (_fingerprint(served.node), dict(book.committed), dict(book.reveals))

    before = state()
    good = json.loads(_reveal(wallets[1], header).to_json())
    other, _ = make_contribution(wallets[2], seed=2)
    cases = [
        (b"{", 400, "not JSON"),
        (json.dumps({**good, "extra": 1}).encode(), 400, "unknown field"),
        (json.dumps({**good, "held": []}).encode(), 422, "own commitment"),
        (json.dumps({**good, "held": good["held"] * 2}).encode(), 422, "sorted by wallet"),
        # Signed by wallet 1 over wallet 2's header: a reveal is its contributor's own.
        (
            json.dumps({**good, "contribution": json.loads(other.to_json())}).encode(),
            422,
            "signed by the wallet",
        ),
        # Someone changed the list after wallet 1 signed it.
        (
            json.dumps(
                {**good, "held": [*good["held"], {"wallet": "ff" * 32, "payload_sha256": "00" * 32}]}
            ).encode(),
            422,
            "bad_reveal_signature",
        ),
    ]
    for body, expected, text in cases:
        status, _, reply = await served.send(wallets[1], "POST", wire.REVEAL, body)
        assert status == expected and text in _error(status, reply), (text, _error(status, reply))
    for wrong in (
        make_contribution(wallets[1], stage=1)[0],
        make_contribution(wallets[1], round_=ROUND + 1)[0],
    ):
        status, reason = await served.reveal(wrong)
        assert (status, reason.split(":")[0]) in ((422, "wrong_stage"), (409, "wrong_round"))
    big = _reveal(wallets[1], header).to_json() + b" " * served.node.limits.max_reveal_bytes
    status, _, reply = await served.send(wallets[1], "POST", wire.REVEAL, big)
    assert status == 413
    assert state() == before
    # A second, different list of the same wallet for the same contribution: the first stands.
    assert await served.reveal(header) == (204, "")
    second = _reveal(wallets[1], header, other)
    status, _, reply = await served.send(wallets[1], "POST", wire.REVEAL, second.to_json())
    assert status == 409 and _error(status, reply).startswith("reveal_conflict")
    assert book.reveals[wallets[1].public_key_hex] == _reveal(wallets[1], header)


@pytest.mark.asyncio
async def test_two_signed_reveals_of_one_wallet_are_equivocation(served, wallets, make_contribution) -> None:
    from neuroshard.node.p2p.screening import new_bans

    header, payload = make_contribution(wallets[1])
    other, _ = make_contribution(wallets[2], seed=2)
    assert await served.push(wallets[1], header, payload) == (204, "")
    book = served.node.books[ROUND]
    w = wallets[1].public_key_hex
    first = book.reveals[w]
    # Tampered after signing: no proof of anything, refused before the book sees it.
    forged = json.loads(first.to_json()) | {
        "held": json.loads(_reveal(wallets[1], header, other).to_json())["held"]
    }
    status, _, reply = await served.send(wallets[1], "POST", wire.REVEAL, json.dumps(forged).encode())
    assert status == 422 and _error(status, reply).startswith("bad_reveal_signature")
    assert book.reveal_equivocators == {} and new_bans(served.node.books, {}) == {}
    # Validly signed over another list: refused, the first stands, and the wallet is proven to lie.
    second = _reveal(wallets[1], header, other)
    status, _, reply = await served.send(wallets[1], "POST", wire.REVEAL, second.to_json())
    assert status == 409 and _error(status, reply).startswith("reveal_conflict")
    assert book.reveals[w] == first and w in book.accepted
    assert book.reveal_equivocators == {w: (first, second)} and book.proven_equivocators() == {w}
    assert new_bans(served.node.books, {}) == {w: f"equivocated in round {ROUND} (two reveals)"}
    # Sending the first again is a duplicate, not a conflict.
    assert await served.reveal(header) == (204, "")


@pytest.mark.asyncio
async def test_reveal_of_a_second_header_is_equivocation(served, wallets, make_contribution) -> None:
    committed, _ = make_contribution(wallets[1], seed=1)
    served.node.commit(committed)  # as a digest would have brought it in the commit phase
    copy, _ = make_contribution(wallets[1], seed=2)  # a new header, signed after seeing payloads
    status, reason = await served.reveal(copy)
    assert status == 409 and reason.startswith("equivocation")
    book = served.node.books[ROUND]
    w = wallets[1].public_key_hex
    assert book.equivocators[w] == (committed, copy) and w not in book.committed and w not in book.reveals


@pytest.mark.asyncio
async def test_payloads_are_revealed_to_committed_wallets_only(served, wallets, make_contribution) -> None:
    header, payload = make_contribution(wallets[1])
    assert await served.push(wallets[1], header, payload) == (204, "")
    before = _fingerprint(served.node)
    paths = [
        wire.CONTRIBUTION_PULL.format(round=ROUND, wallet=wallets[1].public_key_hex),
        wire.REVEAL_PULL.format(round=ROUND, wallet=wallets[1].public_key_hex),
    ]
    for path in paths:
        status, _, body = await served.send(wallets[3], "GET", path)
        assert status == 403 and _error(status, body).startswith("not_committed")
    assert _fingerprint(served.node) == before
    # Wallet 3 commits through a digest swap (as in the commit phase); then it may pull.
    own, _ = make_contribution(wallets[3], seed=3)
    digest = Digest.create(
        wallets[3], stage=0, round=ROUND, current_round=ROUND, current_hash="ab" * 32, closed=False,
        aggregated=(), entries=(own,),
    )  # fmt: skip
    assert (await served.send(wallets[3], "POST", wire.DIGEST, digest.to_json()))[0] == 200
    for path in paths:
        assert (await served.send(wallets[3], "GET", path))[0] == 200
    status, _, body = await served.send(
        wallets[3], "GET", wire.REVEAL_PULL.format(round=ROUND, wallet="ab" * 32)
    )
    assert status == 404
