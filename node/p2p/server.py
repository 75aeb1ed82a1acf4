"""The peer server: a node's network-side state and the /p2p routes that expose it.

Routes (every refusal is a JSON `ErrorReply`):

| route                                   | in -> out                                             | ok  | refusals        |
|-----------------------------------------|-------------------------------------------------------|-----|-----------------|
| POST /p2p/reveal                        | Reveal JSON (the contributor's, with its header)      | 204 | 400 409 422 429 |
| GET  /p2p/reveal/{round}/{wallet}       | -> that contributor's Reveal JSON                     | 200 | 400 403 404     |
| POST /p2p/contribution                  | `X-NeuroShard-Contribution` header + safetensors Δ    | 204 | 400 409 422 429 |
| GET  /p2p/contribution/{round}/{wallet} | -> the same header + safetensors Δ                    | 200 | 400 403 404     |
| POST /p2p/digest                        | Digest JSON -> this node's Digest for that round      | 200 | 400 422 503     |
| GET  /p2p/peers                         | -> PeerList JSON                                      | 200 |                 |
| POST /p2p/announce                      | the signer's own PeerRecord JSON                      | 204 | 400 422         |
| GET  /p2p/status                        | -> StateInfo JSON                                     | 200 | 503             |
| GET  /p2p/state                         | -> `X-NeuroShard-State` header + safetensors θ, momentum | 200 | 503          |

On every route the `auth` middleware refuses first: 404/405 unknown route or method, 401
unsigned / bad signature / stale timestamp, 413 body over the route's limit, 400 body cut
short, 409 replayed nonce, 503 nonce cache full. 400 = malformed (schema, JSON, safetensors
layout, pickle); 422 = well-formed but wrong (stage, base hash, numel, NaN/inf, signature
of an embedded message); 409 = conflicts with this node's state (round not open or already
closed, equivocation, a payload before its reveal); 403 = a reveal or payload asked for by
a wallet whose commitment for that round this node does not hold.

Commit-then-reveal: a payload is served only to wallets that committed to their own
contribution for the round first, so no one can see a payload and then commit to a copy of
it without signing a second header (equivocation, caught by the digests).

The event loop owns `NodeState`; the training thread only hands it new snapshots
through the loop (`PeerNetwork`), so handlers never see a half-updated state.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from ..wallet import Wallet
from . import wire
from .auth import BODY, PEER_WALLET, Clock, NonceCache, Traffic, auth_middleware
from .codec import decode_delta, delta_size_bound, encode_state, sha256_hex
from .peers import PeerTable
from .rounds import Contribution, RoundBook
from .state import Snapshot
from .wire import ContributionHeader, Digest, PeerList, PeerRecord, Rejected, Reveal, StateInfo

STREAM_CHUNK = 1 << 20


@dataclass(kw_only=True)
class ServerLimits:
    """Body limits per route and store bounds; every one refuses before memory is spent."""

    max_contribution_bytes: int = 512 << 20
    """Cap on a contribution body before this node knows its stage's size (then the exact bound applies)."""
    max_digest_bytes: int = 1 << 20
    """A digest holds ~600 bytes per header; 1 MiB fits the 1024-header maximum."""
    max_announce_bytes: int = 4096
    max_reveal_bytes: int = 128 << 10
    """A reveal holds ~130 bytes per commitment listed: 128 KiB fits the 512-wallet maximum."""
    max_contributors: int = 256
    """Distinct wallets per round a node keeps (accepted + rejected); more is refused with 429."""
    keep_rounds: int = 2
    """Rounds behind the current one whose books are kept to serve late pullers."""


class NodeState:
    """Everything the peer server knows. Not thread-safe: only the event loop touches it."""

    def __init__(
        self,
        *,
        wallet: Wallet,
        stage: int,
        peers: PeerTable,
        nonces: NonceCache,
        clock: Clock,
        limits: ServerLimits,
        log: Callable[[str], None],
    ) -> None:
        self.wallet = wallet
        self.stage = stage
        self.peers = peers
        self.nonces = nonces
        self.clock = clock
        self.limits = limits
        self.log = log
        self.address: str | None = None
        self.announced = False
        """Whether this node's own record is shared (GET /p2p/peers, announcements): from the moment
        it serves a state, so that replicas starting together find each other."""
        self.snapshot: Snapshot | None = None
        self.books: dict[int, RoundBook] = {}
        self.peer_rounds: dict[str, tuple[int, str]] = {}
        """Peer wallet -> (round, θ hash) it last reported (digests and statuses)."""
        self.uploads: Counter[str] = Counter()
        """Wallet -> contribution pushes from it whose body is being received now: pulling the
        same contribution from a third peer meanwhile would only send it twice."""
        self.traffic = Traffic()
        """What the server received and answered (the client counts its own requests)."""
        self.duplicates = 0
        """Contribution payloads received (pushed or pulled) that were already held: wasted bytes."""
        self._status: StateInfo | None = None
        self._state_body: asyncio.Task[tuple[StateInfo, bytes]] | None = None

    # --- state the training thread publishes -------------------------------------------------

    def set_snapshot(self, snapshot: Snapshot) -> None:
        """The replica is now at the start of `snapshot.round`: serve it, open that round's book."""
        self.snapshot = snapshot
        self._status = StateInfo.create(
            self.wallet,
            stage=self.stage,
            round=snapshot.round,
            theta_hash=snapshot.theta_hash,
            momentum_hash=snapshot.momentum_hash,
            numel=snapshot.numel,
        )
        self._state_body = None
        book = self.books.get(snapshot.round)
        if book is None or book.base_hash != snapshot.theta_hash or book.numel != snapshot.numel:
            # A re-sync can change θ_r under an open book: its base-hash verdicts were against the
            # wrong hash, so start the round's book over (peers' digests bring the contributions back).
            self.books[snapshot.round] = RoundBook(
                stage=self.stage,
                round_=snapshot.round,
                base_hash=snapshot.theta_hash,
                numel=snapshot.numel,
                max_wallets=self.limits.max_contributors,
            )
        for old in [
            r for r in self.books if r < snapshot.round - self.limits.keep_rounds or r > snapshot.round
        ]:
            del self.books[old]

    @property
    def status(self) -> StateInfo | None:
        return self._status

    # --- contributions ------------------------------------------------------------------------

    def book_for(self, header: ContributionHeader) -> RoundBook:
        """The open book of the header's round; Rejected (wrong stage or round) when there is none."""
        book = self.books.get(header.round)
        if book is not None:
            return book
        current = "none yet" if self.snapshot is None else str(self.snapshot.round)
        if header.stage != self.stage:
            raise Rejected(
                422,
                "wrong_stage",
                f"contribution is for stage {header.stage}, this replica holds stage {self.stage}",
            )
        raise Rejected(
            409,
            "wrong_round",
            f"round {header.round} is not open here (this replica is at round {current})",
        )

    def commit(self, header: ContributionHeader) -> None:
        """Hold a validly signed header as its wallet's commitment (this replica's own, at the start of
        its round). Raises Rejected with the reason."""
        self.book_for(header).admit(header)

    def offer_reveal(self, reveal: Reveal) -> bool:
        """Check and hold a contributor's reveal statement (and its header, as its commitment); True if
        new. Raises Rejected or wire.WireError with the reason."""
        book = self.book_for(reveal.contribution)
        if not reveal.signature_valid():
            raise Rejected(422, "bad_reveal_signature", "the reveal's signature does not verify")
        book.admit(reveal.contribution)
        return book.add_reveal(reveal)

    async def offer(self, header: ContributionHeader, payload: bytes) -> bool:
        """Check and store a contribution however it arrived; True if it was new. Its contributor's
        reveal must be held first (409 otherwise, nothing changes).
        Raises Rejected or wire.WireError with the reason."""
        book = self.book_for(header)
        reveal = book.reveals.get(header.wallet)
        if reveal is None or reveal.contribution != header:
            raise Rejected(
                409,
                "not_revealed",
                f"no reveal of {header.wallet[:16]}… for this contribution is held here: send it first",
            )
        if not book.admit(header):
            self.duplicates += 1
            return False
        if sha256_hex(payload) != header.payload_sha256:
            # Not recorded against the wallet: the signed header does not cover these bytes.
            raise Rejected(
                422, "payload_mismatch", "payload sha256 differs from the signed header's payload_sha256"
            )
        book.checking.add(header.wallet)
        try:
            delta = await asyncio.get_running_loop().run_in_executor(
                None, decode_delta, payload, header.encoding, header.numel
            )
        except wire.WireError as exc:
            # Recorded against the wallet (these are the bytes it signed); raises with 400 or 422.
            book.reject(header, f"payload: {exc}", exc.status, exc.code)
        finally:
            book.checking.discard(header.wallet)
        book.accept(Contribution(header, payload, delta))
        return True

    def learn(self, digest: Digest) -> None:
        """Take what a peer's digest tells: its round, its closed set, headers to pull or that prove equivocation."""
        self.peer_rounds[digest.wallet] = (digest.current_round, digest.current_hash)
        book = self.books.get(digest.round)
        if book is None or digest.stage != self.stage:
            return
        if digest.closed:
            book.finals[digest.wallet] = digest.aggregated
            book.changed.set()
        elif digest.current_round > digest.round:
            book.ahead.add(digest.wallet)
            book.changed.set()
        for header in digest.entries:
            if book.header_of(header.wallet) != header:  # a held one skips the signature check
                try:
                    book.admit(header)
                except Rejected:
                    continue  # recorded in the book where it is evidence (equivocation, bad base hash)
            if header.wallet not in book.heard_from() and book.header_of(header.wallet) == header:
                book.wanted.setdefault(header.wallet, header)
                book.wanted_at.setdefault(header.wallet, self.clock())
                book.sources.setdefault(header.wallet, set()).add(digest.wallet)

    def digest(self, round_: int) -> Digest:
        book = self.books.get(round_)
        snapshot = self.snapshot
        if snapshot is None:
            raise Rejected(503, "not_ready", "this node holds no state yet")
        return Digest.create(
            self.wallet,
            stage=self.stage,
            round=round_,
            current_round=snapshot.round,
            current_hash=snapshot.theta_hash,
            closed=book is not None and book.closed,
            aggregated=(book.aggregated or ()) if book is not None else (),
            entries=tuple(book.headers()) if book is not None else (),
        )

    # --- peers and state ----------------------------------------------------------------------

    def own_record(self) -> PeerRecord:
        if self.address is None:
            raise RuntimeError("the server has no announce address yet")
        return PeerRecord.create(
            self.wallet, address=self.address, stage=self.stage, last_seen=round(self.clock(), 3)
        )

    def peer_list(self) -> PeerList:
        records = self.peers.records(self.clock())
        if self.announced:
            records = [self.own_record(), *records]
        return PeerList(peers=tuple(records[: wire.MAX_PEER_RECORDS]))

    async def state_body(self) -> tuple[StateInfo, bytes]:
        """The current snapshot as safetensors, encoded once per snapshot off the event loop."""
        if self.snapshot is None or self._status is None:
            raise Rejected(503, "not_ready", "this node holds no state yet")
        if self._state_body is None:
            snapshot, status = self.snapshot, self._status
            loop = asyncio.get_running_loop()

            async def build() -> tuple[StateInfo, bytes]:
                body = await loop.run_in_executor(None, encode_state, snapshot.theta, snapshot.momentum)
                return status, body

            self._state_body = asyncio.ensure_future(build())
        return await asyncio.shield(self._state_body)

    @contextmanager
    def receiving(self, route: str, wallet: str) -> Iterator[None]:
        if route != "contribution_push":
            yield
            return
        self.uploads[wallet] += 1
        try:
            yield
        finally:
            self.uploads[wallet] -= 1
            if not self.uploads[wallet]:
                del self.uploads[wallet]

    def body_limit(self, route: str) -> int:
        if route == "contribution_push":
            numel = self.snapshot.numel if self.snapshot is not None else None
            bound = delta_size_bound(numel) if numel is not None else self.limits.max_contribution_bytes
            return min(bound, self.limits.max_contribution_bytes)
        if route == "digest":
            return self.limits.max_digest_bytes
        if route == "announce":
            return self.limits.max_announce_bytes
        if route == "reveal_push":
            return self.limits.max_reveal_bytes
        return 0  # GET routes carry no body


def _json(message: wire.Message) -> web.Response:
    return web.Response(status=200, body=message.to_json(), content_type="application/json")


class ServerExtension(Protocol):
    """More routes on the same server, behind the same signed-request middleware (the pipeline)."""

    def add_routes(self, app: web.Application) -> None: ...

    def body_limit(self, route: str) -> int | None:
        """The body limit of one of this extension's routes; None for routes it does not own."""


def build_app(
    node: NodeState, *, window_s: float, extensions: Sequence[ServerExtension] = ()
) -> web.Application:
    """The aiohttp application serving `node` (and the routes of `extensions`)."""

    def body_limit(route: str) -> int:
        for extension in extensions:
            limit = extension.body_limit(route)
            if limit is not None:
                return limit
        return node.body_limit(route)

    app = web.Application(
        middlewares=[
            auth_middleware(
                nonces=node.nonces,
                body_limit=body_limit,
                clock=node.clock,
                window_s=window_s,
                traffic=node.traffic,
                receiving=node.receiving,
            )
        ]
    )

    async def push(request: web.Request) -> web.StreamResponse:
        raw = request.headers.get(wire.CONTRIBUTION_HEADER)
        if raw is None:
            raise Rejected(400, "malformed", f"missing {wire.CONTRIBUTION_HEADER} header")
        header = ContributionHeader.from_json(raw)
        await node.offer(header, request[BODY])
        return web.Response(status=204)

    def committed_book(request: web.Request) -> tuple[RoundBook | None, str]:
        """(the book of the path's round or None, the path's wallet); 403 unless the requesting wallet
        committed to that round here: payloads are revealed to committed wallets only."""
        round_text, wallet = request.match_info["round"], request.match_info["wallet"]
        if not round_text.isdigit() or len(round_text) > 16:
            raise Rejected(400, "malformed", f"round {round_text[:20]!r} is not a non-negative integer")
        wire.hex_bytes(32)(wallet, "wallet")
        book = node.books.get(int(round_text))
        if book is not None and request[PEER_WALLET] not in book.committed:
            raise Rejected(
                403,
                "not_committed",
                f"wallet {request[PEER_WALLET][:16]}… holds no commitment for round {round_text} here: "
                "commit (through a digest) before asking for payloads",
            )
        return book, wallet

    async def reveal_push(request: web.Request) -> web.StreamResponse:
        node.offer_reveal(Reveal.from_json(request[BODY]))
        return web.Response(status=204)

    async def reveal_pull(request: web.Request) -> web.StreamResponse:
        book, wallet = committed_book(request)
        held = book.reveals.get(wallet) if book is not None else None
        if held is None:
            raise Rejected(404, "not_held", f"no reveal of {wallet[:16]}… for that round here")
        return _json(held)

    async def pull(request: web.Request) -> web.StreamResponse:
        book, wallet = committed_book(request)
        round_text = request.match_info["round"]
        held = book.accepted.get(wallet) if book is not None else None
        if held is None:
            raise Rejected(
                404, "not_held", f"no accepted contribution of {wallet[:16]}… for round {round_text} here"
            )
        return web.Response(
            status=200,
            body=held.payload,
            headers={wire.CONTRIBUTION_HEADER: held.header.to_json().decode()},
            content_type="application/octet-stream",
        )

    async def digest(request: web.Request) -> web.StreamResponse:
        incoming = Digest.from_json(request[BODY])
        if incoming.wallet != request[PEER_WALLET]:
            raise Rejected(422, "not_own", "a digest must be signed by the wallet that sends the request")
        if not incoming.signature_valid():
            raise Rejected(422, "bad_digest_signature", "the digest's signature does not verify")
        if incoming.stage != node.stage:
            raise Rejected(
                422,
                "wrong_stage",
                f"digest is for stage {incoming.stage}, this replica holds stage {node.stage}",
            )
        node.learn(incoming)
        return _json(node.digest(incoming.round))

    async def peers(request: web.Request) -> web.StreamResponse:
        return _json(node.peer_list())

    async def announce(request: web.Request) -> web.StreamResponse:
        record = PeerRecord.from_json(request[BODY])
        if record.wallet != request[PEER_WALLET]:
            raise Rejected(422, "not_own", "a node can only announce its own record")
        if not record.signature_valid():
            raise Rejected(422, "bad_record_signature", "the peer record's signature does not verify")
        node.peers.merge([record], node.clock())
        return web.Response(status=204)

    async def status(request: web.Request) -> web.StreamResponse:
        if node.status is None:
            raise Rejected(503, "not_ready", "this node holds no state yet")
        return _json(node.status)

    async def state(request: web.Request) -> web.StreamResponse:
        info, body = await node.state_body()
        response = web.StreamResponse(
            status=200,
            headers={wire.STATE_HEADER: info.to_json().decode(), "Content-Type": "application/octet-stream"},
        )
        response.content_length = len(body)
        await response.prepare(request)
        view = memoryview(body)
        for start in range(0, len(body), STREAM_CHUNK):
            await response.write(view[start : start + STREAM_CHUNK])
        await response.write_eof()
        return response

    app.router.add_post(wire.REVEAL, reveal_push, name="reveal_push")
    app.router.add_get(wire.REVEAL_PULL, reveal_pull, name="reveal_pull")
    app.router.add_post(wire.CONTRIBUTION, push, name="contribution_push")
    app.router.add_get(wire.CONTRIBUTION_PULL, pull, name="contribution_pull")
    app.router.add_post(wire.DIGEST, digest, name="digest")
    app.router.add_get(wire.PEERS, peers, name="peers")
    app.router.add_post(wire.ANNOUNCE, announce, name="announce")
    app.router.add_get(wire.STATUS, status, name="status")
    app.router.add_get(wire.STATE, state, name="state")
    for extension in extensions:
        extension.add_routes(app)
    return app
