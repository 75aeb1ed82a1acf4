"""The peer server: a node's network-side state and the /p2p routes that expose it.

Routes (every refusal is a JSON `ErrorReply`):

| route                  | in -> out                                                     | ok      | refusals    |
|------------------------|---------------------------------------------------------------|---------|-------------|
| GET  /p2p/peers        | -> PeerList JSON                                              | 200     |             |
| POST /p2p/announce     | the signer's own PeerRecord JSON                              | 204     | 400 422     |
| GET  /p2p/status       | -> StateInfo JSON                                             | 200     | 503         |
| GET  /p2p/state        | -> `X-NeuroShard-State` header + safetensors θ, momentum      | 200     | 503         |
| GET  /p2p/obj/{name}   | [Range] [?wait=] -> an outer-round object (objects.py)        | 200 206 | 400 404 416 |

The object route is a `ServerExtension` (``objects.ObjectRoutes``) that `PeerPlane` always
adds; the pipeline's forward route (``pipeline``) and the verifier's GET /p2p/replay/{round}
(``replay``) are extensions the CLI adds where they apply.

On every route the `auth` middleware refuses first: 404/405 unknown route or method, 401
unsigned / bad signature / stale timestamp, 413 body over the route's limit, 400 body cut
short, 409 replayed nonce, 503 nonce cache full. 400 = malformed (schema, JSON); 422 =
well-formed but wrong (a record not signed by the requesting wallet, a bad signature).

The event loop owns `NodeState`; the training thread only hands it new snapshots
through the loop (`PeerPlane`), so handlers never see a half-updated state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aiohttp import web

from neuroshard.protocol.peer import (
    ANNOUNCE,
    MAX_PEER_RECORDS,
    PEERS,
    STATE,
    STATE_HEADER,
    STATUS,
    PeerList,
    PeerRecord,
    StateInfo,
)
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.schema import Message
from neuroshard.protocol.signing import NonceCache

from ..codec import encode_state
from ..wallet import Wallet
from .auth import BODY, PEER_WALLET, Clock, Traffic, auth_middleware
from .peers import PeerTable
from .state import Snapshot

STREAM_CHUNK = 1 << 20


@dataclass(kw_only=True)
class ServerLimits:
    """Body and memory limits of the peer server; every one refuses before memory is spent."""

    max_contribution_bytes: int = 512 << 20
    """Cap on one Δ object of this replica's rounds; its object shelf (objects.py) is bounded at
    four times this (network.py)."""
    max_announce_bytes: int = 4096


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
        self.traffic = Traffic()
        """What the server received and answered (the client counts its own requests)."""
        self.state_reads = 0
        """GET /p2p/status and /p2p/state answered: the reads of a replica that is still in a round
        (its θ-hash vote, a re-sync), as opposed to gossip (`PeerPlane.linger` watches them)."""
        self._status: StateInfo | None = None
        self._state_body: asyncio.Task[tuple[StateInfo, bytes]] | None = None

    # --- state the training thread publishes -------------------------------------------------

    def set_snapshot(self, snapshot: Snapshot) -> None:
        """The replica is now at the start of `snapshot.round`: serve its status and state."""
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

    @property
    def status(self) -> StateInfo | None:
        return self._status

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
        return PeerList(peers=tuple(records[:MAX_PEER_RECORDS]))

    async def state_body(self) -> tuple[StateInfo, bytes]:
        """The current snapshot as safetensors, encoded once per snapshot off the event loop."""
        if self.snapshot is None or self._status is None:
            raise Refused("not_ready", "this node holds no state yet")
        if self._state_body is None:
            snapshot, status = self.snapshot, self._status
            loop = asyncio.get_running_loop()

            async def build() -> tuple[StateInfo, bytes]:
                body = await loop.run_in_executor(None, encode_state, snapshot.theta, snapshot.momentum)
                return status, body

            self._state_body = asyncio.ensure_future(build())
        return await asyncio.shield(self._state_body)

    def body_limit(self, route: str) -> int:
        if route == "announce":
            return self.limits.max_announce_bytes
        return 0  # GET routes carry no body


def _json(message: Message) -> web.Response:
    return web.Response(status=200, body=message.to_json(), content_type="application/json")


class ServerExtension(Protocol):
    """More routes on the same server, behind the same signed-request middleware (the pipeline)."""

    def add_routes(self, app: web.Application) -> None: ...

    def body_limit(self, route: str) -> int | None:
        """The body limit of one of this extension's routes; None for routes it does not own."""


@runtime_checkable
class RefusesUnread(Protocol):
    """An extension that refuses some requests on the wallet they claim, before their bodies are
    read (node.p2p.auth.auth_middleware's `unread`)."""

    def refuses_unread(self, route: str, wallet: str) -> Refused | None: ...


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

    early = [e for e in extensions if isinstance(e, RefusesUnread)]

    def unread(route: str, wallet: str) -> Refused | None:
        for extension in early:
            refused = extension.refuses_unread(route, wallet)
            if refused is not None:
                return refused
        return None

    app = web.Application(
        middlewares=[
            auth_middleware(
                nonces=node.nonces,
                body_limit=body_limit,
                clock=node.clock,
                window_s=window_s,
                traffic=node.traffic,
                unread=unread if early else None,
            )
        ]
    )

    async def peers(request: web.Request) -> web.StreamResponse:
        return _json(node.peer_list())

    async def announce(request: web.Request) -> web.StreamResponse:
        record = PeerRecord.from_json(request[BODY])
        if record.wallet != request[PEER_WALLET]:
            raise Refused("not_own", "a node can only announce its own record")
        if not record.signature_valid():
            raise Refused("bad_record_signature", "the peer record's signature does not verify")
        node.peers.merge([record], node.clock())
        return web.Response(status=204)

    async def status(request: web.Request) -> web.StreamResponse:
        node.state_reads += 1
        if node.status is None:
            raise Refused("not_ready", "this node holds no state yet")
        return _json(node.status)

    async def state(request: web.Request) -> web.StreamResponse:
        node.state_reads += 1
        info, body = await node.state_body()
        response = web.StreamResponse(
            status=200,
            headers={STATE_HEADER: info.to_json().decode(), "Content-Type": "application/octet-stream"},
        )
        response.content_length = len(body)
        await response.prepare(request)
        view = memoryview(body)
        for start in range(0, len(body), STREAM_CHUNK):
            await response.write(view[start : start + STREAM_CHUNK])
        await response.write_eof()
        return response

    app.router.add_get(PEERS, peers, name="peers")
    app.router.add_post(ANNOUNCE, announce, name="announce")
    app.router.add_get(STATUS, status, name="status")
    app.router.add_get(STATE, state, name="state")
    for extension in extensions:
        extension.add_routes(app)
    return app
