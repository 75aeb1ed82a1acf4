"""`PeerNetwork`: the bridge between the synchronous training loop and the asyncio peer plane.

The trainer runs on its own thread and knows nothing of the network. `PeerNetwork` runs
an event loop in a background thread (the aiohttp server, the client, peer gossip) and
offers the trainer two blocking calls:

- ``join_state(diloco)`` once before training: find the stage's peers; if they are ahead
  (a joiner, or a restart after a long pause) or agree on a different θ, adopt their
  state (hash-verified); then publish this replica's state and announce it.
- ``finish_round(diloco)`` as the trainer's round hook: contribute Δ, run the exchange,
  aggregate and step (or, if late, adopt the peers' new state), then compare θ hashes
  and re-sync from the majority if this replica is in the minority.

and one non-blocking query, ``round_closing(r)``: True once a strict majority of the stage's
live replicas (this one counted, not yet pushed) have committed to a contribution for round r
(a validly signed header this replica holds). A replica still in its inner loop then stops early and contributes the
Δ of the steps it has done, with their token count (issue #4: "slow replicas contribute what
they have"), instead of making the majority wait for its last steps. The rounds still agree
exactly: the short Δ is pushed and exchanged like any other, and every replica waits for every
live peer before it closes the set. A majority, so a minority — attackers pushing at once
included — cannot cut the honest replicas' rounds short on its own. The trainer decides whether
it has done enough steps to stop (``Trainer.close_rounds_when``); validation is unchanged.

Wiring in a CLI::

    network = PeerNetwork(network_config_from_args(args), wallet, stage=0, log=log, stop=stop)
    network.start()
    trainer = Trainer(..., finish_round=network.finish_round)
    trainer.close_rounds_when(network.round_closing)
    network.join_state(trainer.diloco)
    try: trainer.run(stop)
    finally: network.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from aiohttp import web

from ..diloco import DiLoCo
from ..validation import ValidationConfig
from ..wallet import Wallet
from .auth import REPLAY_WINDOW_S, Clock, NonceCache, PeerClient, Traffic
from .codec import encode_delta, sha256_hex
from .exchange import Adopted, Closed, Exchange, ExchangeTimings, Late
from .peers import PeerTable
from .quorum import quorum, vouched
from .rounds import AggregationRule, Contribution, RoundReport, aggregate, ordered_mean, plurality
from .screening import new_bans, screen
from .server import NodeState, ServerExtension, ServerLimits, build_app
from .state import adopt_state, snapshot_of, theta_sha256
from .wire import ENCODINGS, ContributionHeader, InvalidMessage, parse_address

if TYPE_CHECKING:  # attack code stays out of the honest import path
    from .byzantine import Attacker, Forged

T = TypeVar("T")


def majority_pushed(pushed: int, replicas: int) -> bool:
    """Whether `pushed` other replicas are a strict majority of a stage of `replicas` (this one
    included, not yet pushed): with 4, all 3 others; with 5, 3 of the 4; never with 2."""
    return 2 * pushed > replicas


MAJORITY_POLL_S = 0.05
"""How often the loop checks whether a majority pushed the current round: a slow replica stops at
most this much (plus one inner step) after it could have."""


@dataclass(kw_only=True)
class NetworkConfig:
    """The peer plane of one node. Defaults suit a node on the open internet at production H."""

    host: str = "127.0.0.1"
    """Address the peer server binds; 0.0.0.0 accepts other machines (then set `announce`)."""
    port: int = 7420
    """TCP port of the peer server; 0 picks a free one (tests, several nodes on one machine)."""
    announce: str | None = None
    """host:port peers should dial (NAT, port forwarding); default host:port as bound."""
    peers: tuple[str, ...] = ()
    """Bootstrap host:port addresses; the rest is learned by peer exchange."""
    encoding: str = "int8"
    """Δ encoding: "int8" (≈1.02 bytes/value, ~0.7% relative error measured on Gaussian Δ) or
    "fp16" (2 bytes/value). Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512)
    trains without loss with outer gradients at 4 bits, so 8 is comfortable."""
    round_timeout_s: float = 120.0
    """How long a replica waits, after its own H steps, for the stage's other contributions."""
    hash_check_timeout_s: float = 15.0
    """How long to wait for the round's participants to report their new θ hash."""
    join_timeout_s: float = 15.0
    """How long `join_state` keeps asking the bootstrap peers before training alone."""
    min_peers: int = 0
    """Stage peers `join_state` waits for (up to join_timeout_s) before it starts: nodes launched
    together on a loaded machine otherwise run their first rounds without the slow starters."""
    digest_interval_s: float = 0.5
    """Longest pause between digest swaps during a round (the first ones come faster)."""
    pull_grace_s: float = 1.0
    """How long a live contributor's own push may take to start before its contribution is pulled
    from a peer that listed it (earlier pulls mostly fetch what is already on its way)."""
    commit_timeout_s: float = 30.0
    """Longest wait for the live stage peers' commitments (signed headers) before this replica
    reveals its payload anyway (capped at half of round_timeout_s). Headers are ~600 bytes, so
    on a healthy network the commit phase ends in a digest swap or two."""
    gossip_interval_s: float = 5.0
    """Seconds between peer-list exchanges (and re-signing this node's own record)."""
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
    replay_window_s: float = REPLAY_WINDOW_S
    limits: ServerLimits | None = None
    """Body and store limits of the peer server; None takes ServerLimits' defaults."""
    validation: ValidationConfig | None = field(default_factory=ValidationConfig)
    """Thresholds of the content checks each closed round's contributions pass before aggregation
    (screening.py); None skips them (bans of proven equivocators still apply)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"NetworkConfig.port must lie in [0, 65535], got {self.port}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"NetworkConfig.encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.pull_grace_s < 0:
            raise ValueError(f"NetworkConfig.pull_grace_s must be >= 0, got {self.pull_grace_s}")
        for name in ("round_timeout_s", "hash_check_timeout_s", "digest_interval_s", "commit_timeout_s", "gossip_interval_s",
                     "peer_ttl_s", "connect_timeout_s", "request_timeout_s", "control_timeout_s", "state_timeout_s",
                     "replay_window_s"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"NetworkConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.join_timeout_s < 0 or self.ban_s < 0 or self.ban_after_failures < 1 or self.min_peers < 0:
            raise ValueError(
                "NetworkConfig: join_timeout_s, ban_s and min_peers must be >= 0, ban_after_failures >= 1"
            )
        try:
            for address in (*self.peers, *([self.announce] if self.announce else [])):
                parse_address(address)
        except InvalidMessage as exc:
            raise ValueError(f"NetworkConfig: {exc}") from None


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """The peer-network flags of `neuroshard-node` (and the swarm's children)."""
    d = NetworkConfig()
    g = parser.add_argument_group("peer network (signed aiohttp protocol between the stage's replicas)")
    g.add_argument("--host", default=d.host, help="address the peer server binds (0.0.0.0: all interfaces)")
    g.add_argument("--port", type=int, default=d.port, help="peer server TCP port (0: any free port)")
    g.add_argument("--announce", help="host:port peers should dial, if not --host:--port (NAT)")
    g.add_argument("--peers", default="", help="comma-separated bootstrap host:port list")
    g.add_argument(
        "--encoding", choices=ENCODINGS, default=d.encoding, help="pseudo-gradient encoding on the wire"
    )
    g.add_argument(
        "--round-timeout",
        type=float,
        default=d.round_timeout_s,
        help="seconds to wait for the other replicas' contributions",
    )
    g.add_argument(
        "--min-peers",
        type=int,
        default=d.min_peers,
        help="stage peers to wait for (15 s at most) before training",
    )


def network_config_from_args(args: argparse.Namespace) -> NetworkConfig:
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    return NetworkConfig(
        host=args.host,
        port=args.port,
        announce=args.announce,
        peers=peers,
        encoding=args.encoding,
        round_timeout_s=args.round_timeout,
        min_peers=args.min_peers,
    )


class PeerNetwork:
    """One replica's peer plane, running on a background event loop."""

    def __init__(
        self,
        config: NetworkConfig,
        wallet: Wallet,
        stage: int,
        log: Callable[[str], None],
        *,
        aggregate: AggregationRule = ordered_mean,
        tokens_per_step: int = 0,
        stop: threading.Event | None = None,
        clock: Clock = time.time,
        extensions: Sequence[ServerExtension] = (),
        attacker: Attacker | None = None,
    ) -> None:
        self.config = config
        self._extensions = tuple(extensions)
        self.wallet = wallet
        self.stage = stage
        self._log = log
        self._rule = aggregate
        self._tokens_per_step = tokens_per_step
        self._stop = stop or threading.Event()
        self.reports: list[RoundReport] = []
        self.banned: dict[str, str] = {}
        """Wallet -> why: proven equivocators, whose contributions are refused in every later round."""
        self._attacker = attacker
        """Testing only (`neuroshard-node --attack`): forges this replica's contributions."""
        self._stack: torch.Tensor | None = None
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
                digest_interval_s=config.digest_interval_s,
                hash_check_timeout_s=config.hash_check_timeout_s,
                state_timeout_s=config.state_timeout_s,
                pull_grace_s=config.pull_grace_s,
                commit_timeout_s=config.commit_timeout_s,
                control_timeout_s=config.control_timeout_s,
            ),
            log,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._gossip: asyncio.Task[None] | None = None
        self._majority_watch: asyncio.Task[None] | None = None
        self._majority_pushed = -1
        """The latest round a majority of the stage has pushed (written on the loop, read by
        `round_closing` on the training thread: a plain int)."""

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.node.address is None:
            raise RuntimeError("PeerNetwork.start() was not called")
        return self.node.address

    def start(self) -> str:
        """Bind the server, start gossip; returns the announce address."""
        if self._loop is not None:
            raise RuntimeError("PeerNetwork already started")
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
        self._log(
            f"peer server on {self.config.host}:{self.address.rpartition(':')[2]}, announcing {self.address}"
        )
        return self.address

    async def _start(self) -> None:
        cfg = self.config
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
        self._majority_watch = asyncio.create_task(self._watch_majority())

    def round_closing(self, round_: int) -> bool:
        """True once a majority of the stage has pushed round `round_` (module docstring)."""
        return self._majority_pushed >= round_

    async def _watch_majority(self) -> None:
        """Track whether a strict majority of the stage's live replicas have pushed the current round.
        A poll, not a wake-up on `book.changed`: the round driver clears that event for its own waits."""
        while True:
            snapshot = self.node.snapshot
            book = None if snapshot is None else self.node.books.get(snapshot.round)
            if book is not None and book.round > self._majority_pushed:
                # Commitments, not payloads: peers reveal only once every live peer has committed
                # (commit-then-reveal), so a slow replica holds the others' headers long before their Δs.
                pushed = sum(w != self.wallet.public_key_hex for w in book.committed_from())
                if majority_pushed(pushed, replicas=len(self._exchange.stage_peers()) + 1):
                    self._majority_pushed = book.round
            await asyncio.sleep(MAJORITY_POLL_S)

    async def _gossip_forever(self) -> None:
        while True:
            try:
                await self._exchange.gossip_once()
            except Exception as exc:  # a gossip bug must not kill discovery for good
                self._log(f"peer gossip failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(self.config.gossip_interval_s)

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
        for task in (self._gossip, self._majority_watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self._exchange.close()
        await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def __enter__(self) -> PeerNetwork:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the network loop and wait for it from the calling (training) thread."""
        if self._loop is None:
            coro.close()
            raise RuntimeError("PeerNetwork.start() was not called")
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
        """(client, server) byte counters so far, copied on the network loop."""

        async def read() -> tuple[Traffic, Traffic]:
            return dataclasses.replace(self._client.traffic), dataclasses.replace(self.node.traffic)

        return self._call(read(), timeout=10.0)

    def live_peers(self) -> list[str]:
        """Wallets (public key hex) of the live replicas of this stage, read on the network loop."""

        async def read() -> list[str]:
            return [e.wallet for e in self._exchange.stage_peers()]

        return self._call(read(), timeout=10.0)

    def add_bootstrap(self, addresses: list[str]) -> None:
        """Also dial these host:port addresses when gossiping (the verifier's peer list, node.tracker)."""

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
            except InvalidMessage:
                self._log(f"ignored peer address {address!r} from the verifier")
        if valid and self._loop is not None:
            self._call(add(), timeout=10.0)

    def _publish(self, diloco: DiLoCo, *, announce: bool = False) -> None:
        snapshot = snapshot_of(diloco)

        async def publish() -> None:
            self.node.set_snapshot(snapshot)
            self.node.announced = self.node.announced or announce

        self._call(publish(), timeout=30.0)

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
            if adopted is not None or loop.time() >= deadline or self._stop.is_set():
                return adopted
            # The holders moved on to the next round between status and download: ask again.

    # --- the round hook -----------------------------------------------------------------------

    def finish_round(self, diloco: DiLoCo) -> None:
        """The trainer's `finish_round`: afterwards diloco is at the next round's start."""
        started = time.monotonic()
        cfg = self.config
        if self.node.snapshot is None or self.node.snapshot.round != diloco.round:
            # join_state was not called, or the engine was replaced (vocabulary growth).
            self._publish(diloco, announce=True)
        assert self.node.snapshot is not None
        r, numel = diloco.round, diloco.theta_round.numel()
        own_hash = theta_sha256(diloco.theta_round)
        if own_hash != self.node.snapshot.theta_hash:
            self._log(
                f"round {r}: θ_round changed during the round ({self.node.snapshot.theta_hash[:16]} -> {own_hash[:16]})"
            )
        delta = diloco.pseudo_gradient()
        tokens = diloco.steps_in_round * self._tokens_per_step
        payload = encode_delta(delta, cfg.encoding)
        header = ContributionHeader.create(
            self.wallet,
            stage=self.stage,
            round=r,
            base_hash=own_hash,
            tokens=tokens,
            encoding=cfg.encoding,
            numel=numel,
            payload_sha256=sha256_hex(payload),
        )
        own = Contribution(header, payload)
        forged = None if self._attacker is None else self._forge(diloco, delta, header)
        if forged is not None:
            own = forged.own
        exchange_started, exchange_clock = time.monotonic(), self.node.clock()
        slack = 2 * cfg.request_timeout_s + cfg.state_timeout_s
        try:
            outcome: Closed | Late = self._call(
                self._exchange.run_round(
                    own, cfg.round_timeout_s, self._stop, None if forged is None else forged.outgoing
                ),
                timeout=cfg.round_timeout_s + slack,
            )
        except Exception as exc:  # the hook must still leave the engine at the next round's start
            self._log(
                f"round {r}: exchange failed ({type(exc).__name__}: {exc}); using this replica's Δ alone"
            )
            outcome = Closed((own,) if forged is None else ())  # a forged one may not even decode
        step_started = time.monotonic()
        resynced_from: str | None = None
        screened: tuple[tuple[str, str], ...] = ()
        if isinstance(outcome, Closed):
            self._call(self._update_bans(), timeout=10.0)
            held = self._call(self._reveal_lists(r), timeout=10.0)
            kept = screen(outcome.contributions, numel, cfg.validation, self.banned, held)
            screened = kept.rejected
            if kept.accepted:
                stack = self._stack_buffer(len(kept.accepted), numel)
                diloco.outer_step(aggregate(kept.accepted, numel, self._rule, stack))
            else:  # every contribution refused: the same zero step on every replica holding this set
                self._log(f"round {r}: every contribution was refused; stepping with Δ = 0")
                diloco.outer_step(torch.zeros(numel))
            accepted = tuple(c.header.wallet for c in kept.accepted)
        else:
            self._log(f"round {r}: late ({outcome.reason}); adopting the peers' state")
            accepted = ()
            adopted = self._call(self._exchange.sync_state(r + 1, numel, self._stop), timeout=slack)
            if adopted is None:
                self._log(f"round {r}: no peer state to adopt; applying this replica's own Δ alone")
                diloco.outer_step(aggregate([own], numel, self._rule) if forged is None else delta)
            else:
                adopt_state(diloco, adopted.theta, adopted.momentum, adopted.info.round)
                resynced_from = adopted.info.wallet
        self._publish(diloco)
        vote_started = time.monotonic()
        agree, voters = 1, 1
        if not self._stop.is_set():
            try:
                resynced, agree, voters = self._check_hash(diloco, accepted)
                resynced_from = resynced or resynced_from
            except Exception as exc:  # a later round's check (or its base-hash rejections) will catch up
                self._log(f"round {r}: hash check failed ({type(exc).__name__}: {exc})")
        done = time.monotonic()
        rejected, equivocators, revealed_at = self._call(self._verdicts(r), timeout=10.0)
        report = RoundReport(
            stage=self.stage,
            round=r,
            accepted=accepted,
            rejected=tuple(sorted({**dict(rejected), **dict(screened)}.items())),
            equivocators=equivocators,
            late=not isinstance(outcome, Closed),
            next_round=diloco.round,
            theta_hash=self._published_hash(),
            agree=agree,
            voters=voters,
            resynced_from=resynced_from,
            seconds=done - started,
            exchange_s=step_started - exchange_started,
            commit_s=0.0 if revealed_at is None else max(0.0, revealed_at - exchange_clock),
            step_s=vote_started - step_started,
            vote_s=done - vote_started,
            attack=None if forged is None else forged.note,
        )
        self.reports.append(report)
        self._log(report.line())

    def _forge(self, diloco: DiLoCo, delta: torch.Tensor, honest: ContributionHeader) -> Forged:
        """Testing only: the attacker's contribution(s) for this round (byzantine.py); `honest` is the
        header of its honest Δ, which observing attacks commit to so that peers reveal to them."""
        from .byzantine import HonestRound, observe_peers

        assert self._attacker is not None
        r = diloco.round
        view = HonestRound(
            wallet=self.wallet,
            stage=self.stage,
            round=r,
            base_hash=honest.base_hash,
            theta_round=diloco.theta_round,
            delta=delta,
            encoding=self.config.encoding,
            tokens=honest.tokens,
            peers=tuple(sorted(self.live_peers())),
            observe=lambda s: self._call(observe_peers(self._exchange, honest, s), timeout=s + 10.0),
        )
        return self._attacker.forge(view)

    async def _update_bans(self) -> None:
        """Ban the proven equivocators (screening.new_bans), read on the loop that fills the books."""
        for wallet, reason in new_bans(self.node.books, self.banned).items():
            self.banned[wallet] = reason
            self._log(f"wallet {wallet[:12]} banned: {reason}")

    def _stack_buffer(self, n: int, numel: int) -> torch.Tensor:
        """The (n, d) aggregation input, kept across rounds: at 4 × 29.5M values a fresh stack costs
        ~0.3 s of page faults per round on the bench machine, a reused one none."""
        if self._stack is None or self._stack.shape[0] < n or self._stack.shape[1] != numel:
            self._stack = torch.empty(n, numel, dtype=torch.float32)
        return self._stack

    def _published_hash(self) -> str:
        """θ hash of the snapshot just published (hashing θ again would cost ~0.1 s per 25M values)."""
        assert self.node.snapshot is not None
        return self.node.snapshot.theta_hash

    async def _reveal_lists(self, round_: int) -> dict[str, dict[str, str]]:
        """Wallet -> the commitments its reveal of `round_` lists, read on the loop that fills the book."""
        book = self.node.books.get(round_)
        return {} if book is None else {w: reveal.holds() for w, reveal in book.reveals.items()}

    async def _verdicts(
        self, round_: int
    ) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], float | None]:
        """The round's rejections, equivocators and reveal time, read on the loop that mutates the book."""
        book = self.node.books.get(round_)
        if book is None:
            return (), (), None
        rejected = tuple(sorted((w, rej.reason) for w, rej in book.rejected.items()))
        return rejected, tuple(sorted(book.proven_equivocators())), book.revealed_at

    def _check_hash(self, diloco: DiLoCo, participants: tuple[str, ...]) -> tuple[str | None, int, int]:
        """Compare θ hashes with the peers after the round; adopt the majority's state if ours lost.
        Returns (wallet synced from or None, votes for the final hash, voters)."""
        cfg = self.config
        own_hash = self._published_hash()
        numel = diloco.theta_round.numel()
        check = self._call(
            self._exchange.agree(diloco.round, own_hash, participants, self._stop),
            timeout=cfg.hash_check_timeout_s + 2 * cfg.request_timeout_s,
        )
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
