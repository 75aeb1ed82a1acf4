"""`PeerPlane`: the bridge between the synchronous training loop and the asyncio peer plane.

The trainer runs on its own thread and knows nothing of the network. `PeerPlane` runs
an event loop in a background thread (the aiohttp server, the client, peer gossip) and
offers the trainer two blocking calls:

- ``join_state(diloco)`` once before training: find the stage's peers; if they are ahead
  (a joiner, or a restart after a long pause) or agree on a different θ, adopt their
  state (hash-verified); then publish this replica's state and announce it.
- ``finish_round(diloco)`` as the trainer's round hook: run the partitioned round
  (``neuroshard.node.outer.round``) over the HTTP object store (objects.py: each replica
  serves its own objects, GET /p2p/obj/{name}) with this replica's Δ and the stage's live
  replicas as members, step with its aggregate, then compare θ hashes (exchange.py) and
  re-sync from the majority if this replica is in the minority or behind; then ban the
  wallets it proved to cheat, unless it lost the vote (its own arithmetic is then the
  suspect). If the round fails, the replica steps with its own Δ and the vote
  re-syncs it.

With ``PeerPlaneConfig.relay`` (``--relay s3://BUCKET/PREFIX``) the round's objects of relay
replicas are read from the stage bucket (``outer.port.RoutedStore``); with ``listen=False`` too
(no ``--port``) this replica opens no port and puts everything its server would answer into
the bucket instead (``relay.py``).

The plane also answers one non-blocking query, ``round_closing(r)``, a trainer's
``round_closing``: always
False for now. The majority early close ("slow replicas contribute what they have", issue #4)
counted commitments in the old all-to-all exchange and is not ported to the partitioned round
yet, so every replica runs its full H inner steps.

Wiring (neuroshard.cli.node does it, through constructors)::

    plane = PeerPlane(config, wallet, stage=0, log=log, stop=stop)
    plane.start()
    trainer = Trainer(..., finish_round=plane.finish_round, round_closing=plane.round_closing)
    plane.join_state(trainer.diloco)
    try: trainer.run(stop)
    finally: plane.stop()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from aiohttp import web
from torch import Tensor

from neuroshard.protocol.peer import parse_address
from neuroshard.protocol.refusal import Refused
from neuroshard.protocol.round import ENCODINGS
from neuroshard.protocol.signing import FRESHNESS_WINDOW_S, NonceCache

from ..diloco import DiLoCo
from ..membership import Split, StageRoster, split_members
from ..outer.port import RoundStore, RoutedStore
from ..outer.reduce import ANCHOR_FLOOR
from ..outer.round import OuterRound, RoundFactory
from ..outer.state import RoundConfig, RoundInput, RoundResult
from ..validation import ANCHORED_VALIDATION, ValidationConfig
from ..wallet import Wallet
from .auth import Clock, PeerClient, Traffic
from .bucket import BucketStore, RelayConfig
from .exchange import Adopted, Exchange, ExchangeTimings
from .mailbox import Mailboxed, MailboxRoutes, MailboxServer
from .objects import HttpRoundStore, ObjectRoutes, ObjectShelf
from .peers import PeerEntry, PeerTable
from .quorum import quorum, vouched
from .relay import PEERS_OBJECT, STATUS_OBJECT, Answerer, RelayControl, is_relay, relay_address
from .rounds import AggregationRule, RoundReport, ordered_mean, plurality
from .server import NodeState, ServerExtension, ServerLimits, build_app
from .state import adopt_state, momentum_of, snapshot_of

T = TypeVar("T")


def probation_summary(verdicts: dict[str, str]) -> str:
    """How many probationers' parts passed this owner's screening, were refused, or did not come."""
    kinds = {"passed": 0, "refused": 0, "no commitment": 0, "not screened": 0, "other": 0}
    for verdict in verdicts.values():
        if verdict.endswith("passed screening (no weight)"):
            kinds["passed"] += 1
        elif ": refused: " in verdict:
            kinds["refused"] += 1
        elif verdict.startswith("no commitment"):
            kinds["no commitment"] += 1
        elif verdict.startswith("not screened"):
            kinds["not screened"] += 1
        else:
            kinds["other"] += 1
    return ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n)


JOIN_TRIES = 3
"""Downloads a joiner tries, past its join deadline, of a state a quorum vouched for: a slow
joiner may ask for a round its holders have just left (they serve the round they are in)."""


@dataclass(kw_only=True)
class PeerPlaneConfig:
    """The peer plane of one node. Defaults suit a node on the open internet at production H."""

    host: str = "127.0.0.1"
    """Address the peer server binds; 0.0.0.0 accepts other machines (then set `announce`)."""
    port: int = 7420
    """TCP port of the peer server; 0 picks a free one (tests, several nodes on one machine)."""
    announce: str | None = None
    """host:port peers should dial (NAT, port forwarding); default host:port as bound."""
    relay: RelayConfig | None = None
    """The stage bucket (``--relay s3://BUCKET/PREFIX``): relay replicas' objects are read there."""
    listen: bool = True
    """False: open no port and publish everything through `relay` (a replica behind NAT, relay.py)."""
    peers: tuple[str, ...] = ()
    """Bootstrap host:port addresses; the rest is learned by peer exchange."""
    encoding: str = "int8"
    """Δ encoding: "int8" (≈1.02 bytes/value, ~0.7% relative error measured on Gaussian Δ) or
    "fp16" (2 bytes/value). Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512)
    trains without loss with outer gradients at 4 bits, so 8 is comfortable."""
    round_timeout_s: float = 120.0
    """How long a replica waits, after its own H steps, for the stage's other contributions: the
    round's part and gather deadlines are half of it each (the commit deadline at most half)."""
    hash_check_timeout_s: float = 15.0
    """How long to wait for the round's participants to report their new θ hash."""
    join_timeout_s: float = 15.0
    """How long `join_state` keeps asking the bootstrap peers before training alone."""
    min_peers: int = 0
    """Stage peers `join_state` waits for (up to join_timeout_s) before it starts: nodes launched
    together on a loaded machine otherwise run their first rounds without the slow starters."""
    poll_interval_s: float = 0.5
    """Longest pause between status polls while waiting for the peers' θ hashes or a state to sync
    (the first ones come faster)."""
    commit_timeout_s: float = 30.0
    """Longest wait for the members' round commitments (capped at half of round_timeout_s).
    A commitment is < 2 KB, read by long poll the moment it is published, so on a healthy network
    the commit phase ends as soon as the slowest member has finished its inner steps."""
    gossip_interval_s: float = 5.0
    """Seconds between peer-list exchanges (and re-signing this node's own record)."""
    gossip_fanout: int = 3
    """Live peers (chosen at random) a node swaps peer lists with per interval, besides its bootstrap
    addresses: a record spreads epidemically in O(log n) intervals, and a node's gossip costs
    O(fanout · n) bytes per interval instead of O(n²) (every peer, each list n records long)."""
    peer_ttl_s: float = 30.0
    """A peer whose self-signed record was not refreshed for this long is dropped."""
    ban_after_failures: int = 3
    """Transport failures in a row before a peer is banned (a SIGKILLed replica gets here fast)."""
    ban_s: float = 30.0
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 60.0
    """Whole-request limit for pushing or pulling a contribution."""
    control_timeout_s: float = 10.0
    """Whole-request limit for digests, statuses and peer lists (small JSON)."""
    state_timeout_s: float = 600.0
    """Whole-request limit for a state download (θ and momentum: 8 bytes per parameter)."""
    replay_window_s: float = FRESHNESS_WINDOW_S
    limits: ServerLimits | None = None
    """Body and store limits of the peer server; None takes ServerLimits' defaults."""
    validation: ValidationConfig | None = field(default_factory=ValidationConfig)
    """Thresholds of the per-part content checks an owner runs before aggregating a part
    (``outer.reduce``); None skips them (bans of proven cheats still apply)."""
    anchor_floor: float | None = None
    """The network's ``[aggregation] anchor_floor``: from the round after the first, every round is
    anchored to the outer momentum buffer (``outer.reduce.AnchorCheck``) and screens its parts
    with `anchored_validation`. None: no anchor."""
    anchored_validation: ValidationConfig | None = field(default_factory=lambda: ANCHORED_VALIDATION)
    """The per-part limits of an anchored round (``validation.ANCHORED_VALIDATION``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"PeerPlaneConfig.port must lie in [0, 65535], got {self.port}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"PeerPlaneConfig.encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        for name in ("round_timeout_s", "hash_check_timeout_s", "poll_interval_s", "commit_timeout_s", "gossip_interval_s",
                     "peer_ttl_s", "connect_timeout_s", "request_timeout_s", "control_timeout_s", "state_timeout_s",
                     "replay_window_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"PeerPlaneConfig.{name} must be > 0, got {getattr(self, name)}")
        if not self.listen and self.relay is None:
            raise ValueError(
                "PeerPlaneConfig.listen=False needs a relay bucket: nobody could read this replica"
            )
        if self.join_timeout_s < 0 or self.ban_s < 0 or self.ban_after_failures < 1 or self.min_peers < 0:
            raise ValueError(
                "PeerPlaneConfig: join_timeout_s, ban_s and min_peers must be >= 0, ban_after_failures >= 1"
            )
        try:
            for address in (*self.peers, *([self.announce] if self.announce else [])):
                parse_address(address)
        except Refused as exc:
            raise ValueError(f"PeerPlaneConfig: {exc}") from None


class PeerPlane:
    """One replica's peer plane, running on a background event loop."""

    def __init__(
        self,
        config: PeerPlaneConfig,
        wallet: Wallet,
        stage: int,
        log: Callable[[str], None],
        *,
        aggregate: AggregationRule = ordered_mean,
        tokens_per_step: int = 0,
        stop: threading.Event | None = None,
        clock: Clock = time.time,
        extensions: Sequence[ServerExtension] = (),
        round_factory: RoundFactory = OuterRound,
    ) -> None:
        self.config = config
        self._extensions = tuple(extensions)
        self.wallet = wallet
        self.stage = stage
        self._log = log
        self._tokens_per_step = tokens_per_step
        self._stop = stop or threading.Event()
        self.reports: list[RoundReport] = []
        self.banned: dict[str, str] = {}
        """Wallet -> why: proven cheats (fraud, equivocation), refused as members' inputs in every later round."""
        self._roster: StageRoster | None = None
        """The member list in force (`set_roster`); None: every live stage peer is a member."""
        self._rosters: list[tuple[int, StageRoster | None]] = []
        """(effective round, roster) of the lists received, oldest first: `_roster_for` picks one."""
        limits = config.limits or ServerLimits()
        peers = PeerTable(
            own_wallet=wallet.public_key_hex,
            bootstrap=config.peers,
            ttl_s=config.peer_ttl_s,
            ban_after=config.ban_after_failures,
            ban_s=config.ban_s,
        )
        self.node = NodeState(
            wallet=wallet,
            stage=stage,
            peers=peers,
            nonces=NonceCache(config.replay_window_s),
            clock=clock,
            limits=limits,
            log=log,
        )
        self._client = PeerClient(
            wallet,
            clock=clock,
            connect_timeout_s=config.connect_timeout_s,
            request_timeout_s=config.request_timeout_s,
        )
        self._exchange = Exchange(
            self.node,
            self._client,
            ExchangeTimings(
                poll_interval_s=config.poll_interval_s,
                hash_check_timeout_s=config.hash_check_timeout_s,
                state_timeout_s=config.state_timeout_s,
                control_timeout_s=config.control_timeout_s,
            ),
            log,
            gossip_fanout=config.gossip_fanout,
            counts=self._counts,
        )
        # The round's objects: published on this replica's shelf (served by GET /p2p/obj/...), read
        # from each author's own server. A round holds ~2 Δ objects of the current and the previous
        # round: 8 bytes per parameter at fp16, bounded by the contribution limit.
        self._shelf = ObjectShelf(max_bytes=4 * limits.max_contribution_bytes, max_objects=64 * 1024)
        self._extensions = (*self._extensions, ObjectRoutes(self._shelf))
        http = HttpRoundStore(
            wallet=wallet.public_key_hex,
            shelf=self._shelf,
            client=self._client,
            locate=self._locate,
            transfer_timeout_s=config.request_timeout_s,
        )
        self._store: RoundStore = http
        self._relay: RelayControl | None = None
        if config.relay is not None:
            # A stage with replicas behind NAT: theirs are read from the bucket, the others' over
            # HTTP; this replica publishes on its own server, or on the bucket if it opens no port.
            bucket = BucketStore(config.relay, wallet.public_key_hex, log=log)
            self._relay = self._exchange.relay = RelayControl(bucket, stage, log)
            self._store = RoutedStore(
                http if config.listen else bucket,
                lambda author: bucket if is_relay(self._locate(author)) else http,
            )
        self._round_config = RoundConfig(
            encoding=config.encoding,
            commit_timeout_s=min(config.commit_timeout_s, config.round_timeout_s / 2),
            part_timeout_s=config.round_timeout_s / 2,
            gather_timeout_s=config.round_timeout_s / 2,
            agree_timeout_s=config.hash_check_timeout_s,
            validation=config.validation,
            anchor_floor=ANCHOR_FLOOR if config.anchor_floor is None else config.anchor_floor,
            anchored_validation=config.anchored_validation,
        )
        # The round's implementation: OuterRound; neuroshard.adversary passes its cheating rounds.
        self._outer = round_factory(self._store, wallet, aggregate, self._round_config, log)
        self.last_round: RoundResult | None = None
        """The last round's full result (claims, checks, refusals), for tests and benchmarks."""
        self._last_vote: tuple[float, frozenset[str]] | None = None
        """(peer-clock time the last θ-hash vote began, stage peers that answered it): members().
        None when the last vote failed: members() then goes by reachability alone."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._gossip: asyncio.Task[None] | None = None
        self._challenges: asyncio.Task[None] | None = None
        """The running pass over the verifier's challenges (a relay replica's; relay.py)."""
        self._mailbox: asyncio.Task[None] | None = None
        """A relay replica's requests from the bucket to its loopback server (mailbox.py)."""

    # --- lifecycle ----------------------------------------------------------------------------

    def _locate(self, wallet: str) -> str | None:
        """host:port of a known replica (the round's reads go to its author's own server)."""
        entry = self.node.peers.get(wallet)
        return None if entry is None else entry.address

    @property
    def bucket(self) -> BucketStore | None:
        """The stage bucket, when this replica was given one (``--relay``): how it reaches relay replicas."""
        return None if self._relay is None else self._relay.store

    @property
    def address(self) -> str:
        if self.node.address is None:
            raise RuntimeError("PeerPlane.start() was not called")
        return self.node.address

    def start(self) -> str:
        """Bind the server, start gossip; returns the announce address."""
        if self._loop is not None:
            raise RuntimeError("PeerPlane already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"p2p-{self.wallet.wallet_id[:8]}", daemon=True
        )
        self._thread.start()
        try:
            self._call(self._start(), timeout=30.0)
        except BaseException:
            self.stop()
            raise
        if self.config.listen:
            self._log(
                f"peer server on {self.config.host}:{self.address.rpartition(':')[2]}, announcing {self.address}"
            )
        else:
            assert self.config.relay is not None
            self._log(f"no listening port: taking part through {self.config.relay.url} (outbound only)")
        return self.address

    async def _start(self) -> None:
        cfg = self.config
        if not cfg.listen:
            self.node.address = relay_address(self.wallet.public_key_hex)
            await self._client.start()
            await self._serve_mailbox()
            self._gossip = asyncio.create_task(self._gossip_forever())
            return
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind the peer server to {cfg.host}:{cfg.port}: {exc.strerror}") from None
        port = sock.getsockname()[1]
        if cfg.announce:
            self.node.address = cfg.announce
        elif cfg.host in ("0.0.0.0", "::", ""):
            sock.close()
            raise ValueError(
                f"binding {cfg.host or 'all interfaces'} needs --announce host:port that peers can dial"
            )
        else:
            self.node.address = f"[{cfg.host}]:{port}" if ":" in cfg.host else f"{cfg.host}:{port}"
        self._runner = web.AppRunner(
            build_app(self.node, window_s=cfg.replay_window_s, extensions=self._extensions), access_log=None
        )
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        await self._client.start()
        self._gossip = asyncio.create_task(self._gossip_forever())

    async def _serve_mailbox(self) -> None:
        """A replica with no port whose extensions take POSTs (a pipeline stage > 0): its server on a
        loopback port, fed with the requests senders put in the bucket (mailbox.py)."""
        boxed = [e.mailbox() for e in self._extensions if isinstance(e, Mailboxed)]
        if not boxed or self._relay is None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # the loopback interface only: nothing outside this machine reaches it
        local = f"127.0.0.1:{sock.getsockname()[1]}"
        self._runner = web.AppRunner(
            build_app(self.node, window_s=self.config.replay_window_s, extensions=self._extensions),
            access_log=None,
        )
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        routes = MailboxRoutes.merged(boxed)
        server = MailboxServer(self._relay.store, local=local, routes=routes, log=self._log)
        self._mailbox = asyncio.create_task(server.run())
        self._log(f"taking {', '.join(sorted(routes.routes))} through the bucket (server on {local} only)")

    def round_closing(self, round_: int) -> bool:
        """Whether the stage is already closing round `round_` (a trainer's ``round_closing``):
        always False. The majority early close is not ported to the partitioned round yet (module
        docstring): the old one counted commitments in the all-to-all exchange's round books."""
        return False

    async def _gossip_forever(self) -> None:
        while True:
            try:
                await self._relay_heartbeat()
                self._answer_challenges()
                await self._exchange.gossip_once()
            except Exception as exc:  # a gossip bug must not kill discovery for good
                self._log(f"peer gossip failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.config.gossip_interval_s)

    def _answer_challenges(self) -> None:
        """A replica with no port: answer the verifier's challenges from its bucket (relay.py), on a
        task of its own so that uploading a segment never holds the heartbeat."""
        if self.config.listen or self._relay is None:
            return
        if self._challenges is not None and not self._challenges.done():
            return
        answerers = [e for e in self._extensions if isinstance(e, Answerer)]
        if answerers:
            self._challenges = asyncio.create_task(self._relay.serve_challenges(answerers, self.node.clock))
            self._challenges.add_done_callback(self._challenge_failure)

    def _challenge_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self._log(f"answering the verifier's challenges failed: {type(exc).__name__}: {exc}")

    async def _relay_heartbeat(self) -> None:
        """A replica with no port: put what its server would answer into the bucket (relay.py)."""
        if self.config.listen or self._relay is None:
            return
        if self.node.announced:
            await self._relay.put(PEERS_OBJECT, self.node.peer_list().to_json())
        status = self.node.status
        if status is not None:
            await self._relay.put(STATUS_OBJECT, status.to_json())
            await self._relay.serve_wanted(status.round, self.node.state_body)

    def linger(self, max_s: float, idle_s: float = 3.0) -> None:
        """After this node's last round, keep serving until no replica has read a round object, a
        status or a state for `idle_s` (and none is long-polling), `max_s` has passed, or the node
        is told to stop. Never raises: the run is over, whatever happens here.

        The replicas of a round leave it together, but not all at the same instant: an observer
        (which publishes nothing, so nobody waits for it) or a member slowed by its machine may still
        be reading this round's commitments, echoes and votes. A node that closed its server the
        moment its own round ended would leave them a round with missing parts, stepping to another
        θ. What this node will never publish (its next round's objects) is answered at once, so the
        stage's replicas that train on do not wait for it. Gossip does not count as a read (it never
        stops). A relay replica's objects stay in its bucket, and a node without stage peers has
        no reader: both return at once. A replica further behind than `idle_s` re-syncs later."""
        if self._loop is None or not self.config.listen or max_s <= 0:
            return
        try:
            self._call(self._linger(max_s, idle_s), timeout=max_s + 10.0)
        except Exception as exc:  # leaving anyway: say why, then close
            self._log(f"linger: {type(exc).__name__}: {exc}")

    async def _linger(self, max_s: float, idle_s: float) -> None:
        if not self.node.peers.live(self.node.clock(), stage=self.stage):
            return  # read on the loop, which owns the peer table
        self._shelf.close()  # published objects are still served; unpublished names answered at once
        loop = asyncio.get_running_loop()
        started = quiet_since = loop.time()

        def reads() -> int:
            return self._shelf.served.requests + self.node.state_reads

        seen = reads()
        while loop.time() - started < max_s and not self._stop.is_set():
            await asyncio.sleep(min(0.25, idle_s))
            now = loop.time()
            if reads() != seen or self._shelf.waiting:
                seen, quiet_since = reads(), now
            elif now - quiet_since >= idle_s:
                return

    def stop(self) -> None:
        """Stop gossip, close the client and server, end the loop thread. Idempotent."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            try:
                self._call(self._shutdown(), timeout=10.0)
            except Exception as exc:
                self._log(f"peer network shutdown: {type(exc).__name__}: {exc}")
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10.0)
        loop.close()
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        for task in (self._gossip, self._challenges, self._mailbox):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._relay is not None:
            self._relay.store.close()

    def __enter__(self) -> PeerPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the network loop and wait for it from the calling (training) thread."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("PeerPlane.start() was not called")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"peer network call did not finish within {timeout:.0f} s") from None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the network's event loop and wait for it (for protocol extensions)."""
        return self._call(coro, timeout)

    def traffic(self) -> tuple[Traffic, Traffic]:
        """(client, server) byte counters so far, copied on the network loop. With a relay bucket,
        its requests count as the client's (bodies only: boto3's heads are not counted)."""

        async def read() -> tuple[Traffic, Traffic]:
            client = dataclasses.replace(self._client.traffic)
            if self._relay is not None:
                bucket = self._relay.store.traffic
                client.bytes_sent += bucket.bytes_sent
                client.bytes_received += bucket.bytes_received
                client.requests += bucket.requests
            return client, dataclasses.replace(self.node.traffic)

        return self._call(read(), timeout=10.0)

    def live_peers(self) -> list[str]:
        """Wallets (public key hex) of the live replicas of this stage, read on the network loop."""

        async def read() -> list[str]:
            return [e.wallet for e in self._exchange.stage_peers()]

        return self._call(read(), timeout=10.0)

    def add_bootstrap(self, addresses: list[str]) -> None:
        """Also dial these host:port addresses when gossiping (the verifier's peer list, node.verifier_client)."""

        async def add() -> None:
            known = self.node.peers.bootstrap
            fresh = [a for a in addresses if a not in known and a != self.node.address]
            if fresh:
                self.node.peers.bootstrap = (*known, *fresh)

        valid = []
        for address in addresses:
            try:
                parse_address(address)
                valid.append(address)
            except Refused:
                self._log(f"ignored peer address {address!r} from the verifier")
        if valid and self._loop is not None:
            self._call(add(), timeout=10.0)

    def _publish(self, diloco: DiLoCo, *, announce: bool = False) -> None:
        snapshot = snapshot_of(diloco)

        async def publish() -> None:
            self.node.set_snapshot(snapshot)
            self.node.announced = self.node.announced or announce
            await self._relay_heartbeat()

        self._call(publish(), timeout=30.0)

    def republish(self, diloco: DiLoCo) -> None:
        """Serve `diloco`'s state from now on instead of the snapshot published at the round's end:
        its shape changed at the round boundary (node.vocab: the vocabulary grew), and a joiner or a
        hash check must read the state this replica trains from."""
        self._publish(diloco)

    # --- joining ------------------------------------------------------------------------------

    def join_state(self, diloco: DiLoCo) -> bool:
        """Find the stage's peers and take their state if they are ahead or agree on another θ.
        Returns True if state was adopted. Publishes this replica's state and announces it first:
        replicas starting together must see each other to agree that nobody is ahead."""
        self._publish(diloco, announce=True)
        adopted = self._call(
            self._join(diloco.round, self._published_hash(), diloco.theta_round.numel()),
            timeout=self.config.join_timeout_s + self.config.state_timeout_s + 30.0,
        )
        if adopted is None:
            return False
        adopt_state(diloco, adopted.theta, adopted.momentum, adopted.info.round)
        self._log(
            f"joined by state sync from {adopted.info.wallet[:12]}: round={adopted.info.round} "
            f"θ hash {adopted.info.theta_hash[:16]} (verified)"
        )
        self._publish(diloco)
        return True

    async def _join(self, round_: int, own_hash: str, numel: int) -> Adopted | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.join_timeout_s
        tries = 0
        while True:
            await self._exchange.gossip_once()
            infos = [i for i in await self._exchange.statuses() if i.numel == numel]
            waiting = len(infos) < max(1, self.config.min_peers)
            if waiting and self.node.peers.bootstrap and loop.time() < deadline and not self._stop.is_set():
                await asyncio.sleep(min(0.5, self.config.gossip_interval_s))
                continue
            if not infos:
                self._log("no stage peers answered; starting from this replica's own state")
                return None
            voters = len(infos) + 1
            vote = vouched(infos, round_, voters)
            if vote is None:
                if max(i.round for i in infos) >= round_:
                    self._log(f"peers report other states, none vouched for by a quorum of {quorum(voters)}")
                return None
            with_own = plurality(infos, round_, own_hash)
            if vote.round == round_ and with_own is not None and with_own.theta_hash == own_hash:
                return None  # this replica's state wins its own round's vote
            adopted = await self._exchange.fetch_from(vote, need=quorum(voters))
            tries += 1
            if (
                adopted is not None
                or self._stop.is_set()
                or (loop.time() >= deadline and tries >= JOIN_TRIES)
            ):
                return adopted
            # The holders moved on to the next round between status and download: ask again.

    # --- the round hook -----------------------------------------------------------------------

    def set_roster(self, roster: StageRoster | None, effective_round: int = 0) -> None:
        """Take the stage's member list (the operator's allowlist, or the verifier's signed list of
        admitted and probationary wallets; None: every live peer counts) from round
        `effective_round` on; until then the list held before stays in force, so every replica of
        the stage switches lists at the same round boundary."""
        if roster is not None and roster.stage != self.stage:
            raise ValueError(f"a roster of stage {roster.stage} given to a replica of stage {self.stage}")
        last = self._rosters[-1][1] if self._rosters else self._roster
        self._rosters = [(r, x) for r, x in self._rosters if r < effective_round] + [
            (effective_round, roster)
        ]
        changed = (
            last is None
            or roster is None
            or (roster.admitted, roster.probation) != (last.admitted, last.probation)
        )
        if roster is not None and changed:
            self._log(
                f"membership: {len(roster.admitted)} admitted, {len(roster.probation)} on probation "
                f"({roster.policy}, {roster.source or 'roster'}), from round {effective_round}"
            )
        if len(self._rosters) == 1:
            self._roster = roster  # the first list a replica gets is in force at once

    def _roster_for(self, round_: int) -> StageRoster | None:
        """The list in force at `round_`: the newest one effective by then (older ones are dropped),
        or, before any is, the one already in force."""
        due = [i for i, (effective, _) in enumerate(self._rosters) if effective <= round_]
        if due:
            self._roster = self._rosters[due[-1]][1]
            del self._rosters[: due[-1]]
        return self._roster

    def _counts(self, wallet: str) -> bool:
        """Whether `wallet`'s status counts in θ-hash votes and state-sync quorums: an admitted member
        (or anyone, without a roster). Probationers and unlisted wallets are not even asked."""
        roster = self._roster
        return roster is None or roster.counts(wallet)

    def members(self, round_: int) -> Split:
        """This round's admitted members and probationers, sorted: this replica and the stage peers
        `_counts_as_member` keeps, split by the roster (``neuroshard.node.membership``).

        Replicas that hold the same list derive the same partition; one that holds another list
        signs another `members_sha256`, its commitments are refused by the rest, and the θ-hash vote
        after the round re-syncs it. Liveness is each replica's own view, made to agree in the
        common cases (a crash, a join, a proven cheat); who may be a member at all comes from the
        signed roster, so a flood of fresh wallets changes no member list."""

        async def read() -> list[str]:
            now = self.node.clock()
            reachable = {e.wallet for e in self.node.peers.live(now, self.stage)}
            return [
                e.wallet
                for e in self.node.peers.unexpired(now, self.stage)
                if self._counts_as_member(e, reachable=e.wallet in reachable)
            ]

        live = self._call(read(), timeout=10.0)
        return split_members(live, self.wallet.public_key_hex, self._roster_for(round_), round_)

    def _counts_as_member(self, peer: PeerEntry, *, reachable: bool) -> bool:
        """A stage peer that is not a proven cheat (`self.banned`: it owns no part; every replica
        that applied the proof agrees) is a member if it answered a poll of this replica's last
        θ-hash vote, or was first seen after that vote began (a joiner) and is `reachable` (this
        replica's peer table has not banned its address). With no vote to go by (the first round,
        a failed vote) and for probationers, who are never asked to vote, reachability decides;
        a replica behind NAT counts only where this one reads the stage bucket.

        For a peer that voted, the vote decides, not the peer table: survivors poll at about the
        same time, so they mostly hold the same answers. One that died in the last round answered
        no poll and every survivor leaves it out at once; one that dies in this round answered,
        so every survivor keeps it for this round, whether or not its own table has banned the
        dead address yet: tables ban after their own counts of failures. Its parts go to their
        backups after ``gather_timeout_s``, as they do for a replica that dies after the lists
        were drawn: agreement is bought with one slower round.

        Not promised: a peer that dies within the vote's polls may be in one survivor's answers
        and not another's, and so may one that a replica's table had banned before the vote (a
        vote polls reachable peers only), until its record expires (``peer_ttl_s``)."""
        if peer.wallet in self.banned:
            return False
        if is_relay(peer.address) and self._relay is None:
            return False  # a replica behind NAT is read through the stage bucket, which this one lacks
        if self._last_vote is None or not self._counts(peer.wallet):
            return reachable  # a probationer is never asked for a vote: the live peer table speaks for it
        began, answered = self._last_vote
        return peer.wallet in answered or (reachable and peer.first_seen >= began)

    def finish_round(self, diloco: DiLoCo) -> None:
        """The trainer's `finish_round`: run the partitioned round (``neuroshard.node.outer.round``),
        step with its aggregate, then vote on θ hashes; afterwards diloco is at the next round's start."""
        started = time.monotonic()
        if self.node.snapshot is None or self.node.snapshot.round != diloco.round:
            # join_state was not called, or the engine was replaced (vocabulary growth).
            self._publish(diloco, announce=True)
        assert self.node.snapshot is not None
        r = diloco.round
        # θ_r hashed again, not the published snapshot's hash: a replica whose θ_r changed in memory
        # since it published it (a bit flip) commits to the hash it really computed Δ from, and the
        # members refuse it by base hash instead of aggregating a Δ off another θ.
        own_hash = diloco.weights_hash()
        delta = diloco.pseudo_gradient()
        exchange_started = time.monotonic()
        result: RoundResult | None = None
        split: Split | None = self.members(r)
        me = self.wallet.public_key_hex
        if split is not None and not split.listed and self._roster is not None:
            self._log(
                f"round {r}: wallet {self.wallet.wallet_id} is not on stage {self.stage}'s member list "
                f"({self._roster.source}, policy {self._roster.policy}); observing: stepping with the stage's aggregate"
            )
        elif split is not None and me not in split.members and me not in split.probationers:
            self._log(
                f"round {r}: on probation, and the cap gives this round's {len(split.probationers)} slot(s) to "
                f"others ({split.waiting} waiting); observing: stepping with the stage's aggregate"
            )
        if split is not None and not split.members:
            self._log(
                f"round {r}: no admitted member of the stage is live; stepping with this replica's Δ alone"
            )
            split = None
        if split is not None:
            inp = RoundInput(
                stage=self.stage,
                round=r,
                base_hash=own_hash,
                members=split.members,
                delta=delta,
                tokens=diloco.steps_in_round * self._tokens_per_step,
                banned=frozenset(self.banned),
                probationers=split.probationers,
                anchor=self._anchor(diloco),
            )
            try:
                result = self._call(self._outer.run(inp), timeout=self._round_budget_s())
            except Exception as exc:  # the hook must still leave the engine at the next round's start
                self._log(
                    f"round {r}: the round failed ({type(exc).__name__}: {exc}); stepping with this replica's Δ alone"
                )
                result = None
        step_started = time.monotonic()
        if result is None:
            diloco.outer_step(delta)
            accepted: tuple[str, ...] = (self.wallet.public_key_hex,)
        else:
            diloco.outer_step(result.aggregate)
            accepted = result.committed
        self._publish(diloco)
        self._call(self._store.retire(self.stage, r - 1), timeout=30.0)
        vote_started = time.monotonic()
        agree, voters, resynced_from = 1, 1, None
        if not self._stop.is_set():
            try:
                # A replica that accepted no one's commitment but its own (its θ_r went astray, or
                # it is cut off) waits for every member's vote, not just its own: else it may count
                # before the others have stepped and miss that it is in the minority.
                participants = accepted if len(accepted) > 1 or split is None else split.members
                resynced_from, agree, voters = self._check_hash(diloco, participants)
            except Exception as exc:  # a later round's check (or its base-hash refusals) will catch up
                self._last_vote = None  # else an older vote's answers keep replicas that died since
                self._log(f"round {r}: hash check failed ({type(exc).__name__}: {exc})")
        if result is not None:
            self._ban(r, result.cheats, lost_vote=resynced_from is not None)
        done = time.monotonic()
        refused = {} if result is None else {**result.silent, **result.refused, **result.cheats}
        seconds = {} if result is None else result.seconds
        report = RoundReport(
            stage=self.stage,
            round=r,
            accepted=accepted,
            rejected=tuple(sorted(refused.items())),
            equivocators=tuple(sorted(w for w, why in refused.items() if why.startswith("equivocation"))),
            late=False,
            next_round=diloco.round,
            theta_hash=self._published_hash(),
            agree=agree,
            voters=voters,
            resynced_from=resynced_from,
            seconds=done - started,
            exchange_s=step_started - exchange_started,
            commit_s=seconds.get("commit", 0.0),
            step_s=vote_started - step_started,
            vote_s=done - vote_started,
        )
        self.reports.append(report)
        self.last_round = result
        self._log(report.line())
        if result is not None and result.probation:
            self._log(
                f"round {r}: probationers (no weight in the aggregate): {probation_summary(result.probation)}"
            )

    def _ban(self, round_: int, cheats: dict[str, str], *, lost_vote: bool) -> None:
        """Ban the owners this replica proved to cheat, unless its own state then lost the θ-hash vote.

        A fraud verdict is this replica's own recomputation. When the stage's majority ended the round
        on another θ, that arithmetic is the first suspect (a faulty replica finds every honest owner
        "cheating"), so its verdicts of this round are dropped rather than turned into bans that would
        cut it off from the majority it just re-synced from."""
        for wallet, reason in sorted(cheats.items()):
            if wallet in self.banned or wallet == self.wallet.public_key_hex:
                continue
            if lost_vote:
                self._log(f"round {round_}: not banning {wallet[:12]}: this replica lost the θ-hash vote")
                continue
            self.banned[wallet] = reason
            self._log(f"wallet {wallet[:12]} banned: {reason}")

    def _anchor(self, diloco: DiLoCo) -> Tensor | None:
        """The round's anchor: the outer momentum buffer at the round's start, when the network names
        an anchor floor and the buffer exists (every round after the first; members hold it bit for
        bit, and a joining replica adopts it with θ). None otherwise."""
        if self.config.anchor_floor is None:
            return None
        buffer = momentum_of(diloco)
        return None if buffer is None else buffer.detach().to("cpu", torch.float32).contiguous()

    def _round_budget_s(self) -> float:
        """The longest a round can take: every phase's deadline, the backups' and the checks' reads."""
        c = self._round_config
        return (
            c.commit_timeout_s
            + c.part_timeout_s
            + (c.backups + 1) * (c.gather_timeout_s + c.part_timeout_s)
            + c.agree_timeout_s
            + 60.0
        )

    def _published_hash(self) -> str:
        """θ hash of the snapshot just published (hashing θ again would cost ~0.1 s per 25M values)."""
        assert self.node.snapshot is not None
        return self.node.snapshot.theta_hash

    def _check_hash(self, diloco: DiLoCo, participants: tuple[str, ...]) -> tuple[str | None, int, int]:
        """Compare θ hashes with the peers after the round; adopt the majority's state if ours lost.
        Returns (wallet synced from or None, votes for the final hash, voters)."""
        cfg = self.config
        own_hash = self._published_hash()
        numel = diloco.theta_round.numel()
        began = self.node.clock()
        check = self._call(
            self._exchange.agree(diloco.round, own_hash, participants, self._stop),
            timeout=cfg.hash_check_timeout_s + 2 * cfg.request_timeout_s,
        )
        self._last_vote = (began, check.answered)
        vote = check.vote
        if check.ahead is None and vote.theta_hash == own_hash:
            return None, vote.votes, vote.voters
        if check.ahead is not None:
            self._log(f"after round {diloco.round - 1}: peers already at round {check.ahead}; syncing")
            adopted = self._call(
                self._exchange.sync_state(check.ahead, numel, self._stop),
                timeout=cfg.hash_check_timeout_s + 2 * cfg.state_timeout_s,
            )
        else:
            self._log(
                f"after round {diloco.round - 1}: θ hash {own_hash[:16]} is in the minority "
                f"({vote.votes}/{vote.voters} hold {vote.theta_hash[:16]}); re-syncing"
            )
            adopted = self._call(
                self._exchange.fetch_from(vote, need=quorum(vote.voters)), timeout=2 * cfg.state_timeout_s
            )
        if adopted is None:
            self._log(f"after round {diloco.round - 1}: re-sync failed (no holder sent a verified state)")
            return None, vote.counts.get(own_hash, 0), vote.voters
        adopt_state(diloco, adopted.theta, adopted.momentum, adopted.info.round)
        self._publish(diloco)
        return adopted.info.wallet, vote.votes, vote.voters
