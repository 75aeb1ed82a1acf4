"""The asynchronous side of the peer protocol that is not the round itself: peer gossip, the θ-hash
vote after a round, and state sync.

The outer round runs in ``neuroshard.node.outer.round`` over the object store (objects.py);
`PeerPlane.finish_round` steps with its aggregate, then calls `agree` here to collect the
peers' θ hashes for the new round, and re-syncs (`fetch_from`, `sync_state`) if this replica is
in the minority or behind. `join_state` uses `statuses` and `fetch_from` the same way.

A peer whose record carries a relay address (``relay.is_relay``: a replica behind NAT) is never
dialled: what its server would answer is read from the stage bucket instead (``relay.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor

from neuroshard.protocol.peer import ANNOUNCE, PEERS, STATE, STATE_HEADER, STATUS, PeerList, StateInfo
from neuroshard.protocol.refusal import Refused, malformed

from ..codec import decode_state, state_size_bound
from ..diloco import tensor_digest
from .auth import PeerClient, PeerReply, PeerUnreachable
from .peers import PeerEntry
from .quorum import backing, quorum, vouched
from .relay import PEERS_OBJECT, STATUS_OBJECT, RelayControl, decode_state_object, is_relay
from .rounds import HashVote, plurality
from .server import NodeState

MIN_POLL_S = 0.02
"""First wait between status polls; it grows ×1.5 up to the configured poll interval."""
STATUS_BYTES = 4096
PEER_LIST_BYTES = 1 << 20


@dataclass(kw_only=True)
class ExchangeTimings:
    poll_interval_s: float
    """Longest pause between status polls while waiting for the peers' θ hashes or a state."""
    hash_check_timeout_s: float
    state_timeout_s: float
    control_timeout_s: float
    """Whole-request limit of the small control requests (statuses, peer lists): a peer that
    cannot answer one in this time is not worth waiting for within a round."""


@dataclass(frozen=True)
class Adopted:
    info: StateInfo
    theta: Tensor
    momentum: Tensor | None


@dataclass(frozen=True)
class Agreement:
    vote: HashVote
    """Hashes at the new round, this replica's own included."""
    ahead: int | None
    """The highest round a peer reported beyond the new one (this replica is behind), else None."""
    answered: frozenset[str] = frozenset()
    """Stage peers whose signed status came back in any poll of the vote (alive at the vote).
    Any poll, not the last: replicas stop polling at different times, and a peer that dies in
    between would be in one replica's last poll and not another's (plane.members)."""


class Exchange:
    def __init__(
        self,
        node: NodeState,
        client: PeerClient,
        timings: ExchangeTimings,
        log: Callable[[str], None],
        relay: RelayControl | None = None,
        gossip_fanout: int = 3,
        counts: Callable[[str], bool] = lambda wallet: True,
    ) -> None:
        if gossip_fanout < 1:
            raise ValueError(f"gossip_fanout must be >= 1, got {gossip_fanout}")
        self.node = node
        self.client = client
        self.timings = timings
        self.log = log
        self.gossip_fanout = gossip_fanout
        self._gossip_rng = random.Random()
        self.relay = relay
        """The stage bucket, when this replica was given one: relay peers are read there."""
        self.counts = counts
        """Whether a stage peer's status counts in votes and quorums (an admitted member): the
        others are not asked, so a flood of fresh wallets neither votes nor costs a poll each."""

    @property
    def own(self) -> str:
        return self.node.wallet.public_key_hex

    def stage_peers(self) -> list[PeerEntry]:
        return self.node.peers.live(self.node.clock(), self.node.stage)

    async def call(
        self,
        peer: PeerEntry,
        method: str,
        path: str,
        *,
        max_bytes: int,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> PeerReply | None:
        """A request to a known peer, with failure counting; None when it did not answer. A relay
        peer's peer list and status are read from the bucket; nothing else can be asked of one."""
        if is_relay(peer.address):
            return await self._relay_get(peer.wallet, method, path, max_bytes)
        try:
            reply = await self.client.request(
                method,
                peer.address,
                path,
                max_bytes=max_bytes,
                body=body,
                headers=headers,
                timeout_s=timeout_s,
            )
        except PeerUnreachable as exc:
            if self.node.peers.failed(peer.wallet, self.node.clock()):
                self.log(f"peer {peer.wallet[:12]} at {peer.address} banned after repeated failures ({exc})")
            return None
        self.node.peers.succeeded(peer.wallet)
        return reply

    async def _relay_get(self, wallet: str, method: str, path: str, max_bytes: int) -> PeerReply | None:
        objects = {PEERS: PEERS_OBJECT, STATUS: STATUS_OBJECT}
        if self.relay is None or method != "GET" or path not in objects:
            return None
        body = await self.relay.read(wallet, objects[path], max_bytes)
        return None if body is None else PeerReply(200, {}, body)

    # --- discovery ----------------------------------------------------------------------------

    async def gossip_once(self) -> None:
        """Expire silent peers, then swap peer lists with every bootstrap address and `gossip_fanout`
        live peers drawn at random (epidemic spread: every record reaches every node in O(log n)
        intervals, and a node's cost per interval does not grow with n beyond the list itself)."""
        now = self.node.clock()
        for wallet in self.node.peers.expire(now):
            self.log(f"peer {wallet[:12]} expired: no fresh record for {self.node.peers.ttl_s:.0f} s")
        targets: dict[str, str | None] = dict.fromkeys(self.node.peers.bootstrap)
        live = self.node.peers.live(now)
        for entry in self._gossip_rng.sample(live, min(self.gossip_fanout, len(live))):
            targets[entry.address] = entry.wallet
        targets.pop(self.node.address or "", None)
        await asyncio.gather(*(self._swap_peers(address, wallet) for address, wallet in targets.items()))
        if self.relay is not None:  # relay replicas find each other in the bucket, not by gossip alone
            known = {e.wallet for e in self.node.peers.live(now)} | {self.own}
            fresh = [w for w in await self.relay.wallets() if w not in known]
            await asyncio.gather(*(self._swap_relay_peers(w) for w in fresh))

    async def _swap_relay_peers(self, wallet: str) -> None:
        """Take the peer list a relay replica keeps in the bucket (its own record first)."""
        if self.relay is None:
            return
        body = await self.relay.read(wallet, PEERS_OBJECT, PEER_LIST_BYTES)
        if body is None:
            return
        try:
            listed = PeerList.from_json(body)
        except Refused:
            return
        now = self.node.clock()
        known = {e.wallet for e in self.node.peers.live(now)}
        self.node.peers.merge(listed.peers, now)
        for entry in self.node.peers.live(now):
            if entry.wallet not in known:
                self.log(f"peer {entry.wallet[:12]} (stage {entry.record.stage}) at {entry.address}")

    async def _swap_peers(self, address: str, wallet: str | None) -> None:
        if is_relay(address):
            if wallet is not None:
                await self._swap_relay_peers(wallet)
            return
        now = self.node.clock()
        try:
            reply = await self.client.request(
                "GET",
                address,
                PEERS,
                max_bytes=PEER_LIST_BYTES,
                timeout_s=self.timings.control_timeout_s,
            )
            if not reply.ok:
                raise malformed(f"status {reply.status}: {reply.error()}")
            listed = PeerList.from_json(reply.body)
        except (PeerUnreachable, Refused):
            if wallet is not None:
                self.node.peers.failed(wallet, now)
            return
        if wallet is not None:
            self.node.peers.succeeded(wallet)
        known = {e.wallet for e in self.node.peers.live(now)}
        self.node.peers.merge(listed.peers, now)
        for entry in self.node.peers.live(now):
            if entry.wallet not in known:
                self.log(f"peer {entry.wallet[:12]} (stage {entry.record.stage}) at {entry.address}")
        fresh_enough = now - self.node.peers.ttl_s / 2
        if self.node.announced and not any(
            r.wallet == self.own and r.last_seen >= fresh_enough for r in listed.peers
        ):
            with contextlib.suppress(PeerUnreachable):
                await self.client.request(
                    "POST",
                    address,
                    ANNOUNCE,
                    body=self.node.own_record().to_json(),
                    max_bytes=0,
                    timeout_s=self.timings.control_timeout_s,
                )

    # --- after a round: votes and state ---------------------------------------------------------

    async def statuses(self) -> list[StateInfo]:
        """Signed statuses of the live stage peers that count (`counts`) and answered."""

        async def ask(peer: PeerEntry) -> StateInfo | None:
            reply = await self.call(
                peer, "GET", STATUS, max_bytes=STATUS_BYTES, timeout_s=self.timings.control_timeout_s
            )
            if reply is None or not reply.ok:
                return None
            try:
                info = StateInfo.from_json(reply.body)
            except Refused:
                return None
            if info.wallet != peer.wallet or info.stage != self.node.stage or not info.signature_valid():
                return None
            return info

        answers = await asyncio.gather(
            *(ask(peer) for peer in self.stage_peers() if self.counts(peer.wallet))
        )
        return [a for a in answers if a is not None]

    async def agree(
        self, new_round: int, own_hash: str, participants: Iterable[str], stop: threading.Event
    ) -> Agreement:
        """Poll statuses until every participant of the round reports `new_round` (or later), or
        the hash-check timeout; then count θ hashes at `new_round`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timings.hash_check_timeout_s
        waiting_for = set(participants) - {self.own}
        interval = MIN_POLL_S
        answered: set[str] = set()
        while True:
            infos = await self.statuses()
            answered.update(i.wallet for i in infos)
            # Ahead only if a quorum vouches for a later state: one status claiming a far round must
            # not send this replica hunting for a state nobody else holds (quorum.py).
            later = vouched(infos, new_round + 1, len(infos) + 1)
            ahead = None if later is None else later.round
            pending = {i.wallet for i in infos if i.wallet in waiting_for and i.round < new_round}
            if ahead is not None or not pending or loop.time() >= deadline or stop.is_set():
                vote = plurality(infos, new_round, own_hash)
                assert vote is not None  # own_hash always counts
                return Agreement(vote, ahead, frozenset(answered))
            await asyncio.sleep(interval)
            interval = min(interval * 1.5, self.timings.poll_interval_s)

    async def sync_state(self, min_round: int, numel: int, stop: threading.Event) -> Adopted | None:
        """Adopt the state most peers hold at the highest round ≥ `min_round` a quorum of them
        vouches for (quorum.py).

        Peers announce a closed round before they finish its outer step, so a late replica may
        ask before anyone reports `min_round`: keep asking until the hash-check timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timings.hash_check_timeout_s
        interval = MIN_POLL_S
        while True:
            infos = [i for i in await self.statuses() if i.numel == numel]
            vote = vouched(infos, min_round, len(infos) + 1)
            if vote is not None:
                adopted = await self.fetch_from(vote, need=quorum(len(infos) + 1))
                if adopted is not None:
                    return adopted
                # The holders moved on to the next round between status and download: ask again.
            if loop.time() >= deadline or stop.is_set():
                return None
            await asyncio.sleep(interval)
            interval = min(interval * 1.5, self.timings.poll_interval_s)

    async def fetch_from(self, vote: HashVote, need: int = 1) -> Adopted | None:
        """Download the voted state from one of its holders; θ (and momentum) verified by hash.
        Refuses (None) unless at least `need` holders report the same θ and momentum hashes."""
        momentum_hash, holders = backing(vote)
        if holders < need:
            self.log(
                f"state θ {vote.theta_hash[:16]} of round {vote.round} is vouched for by {holders} peer(s), "
                f"fewer than the quorum of {need}; not adopted"
            )
            return None
        for holder in vote.holders:
            peer = self.node.peers.get(holder.wallet)
            if peer is None or holder.momentum_hash != momentum_hash:
                continue
            adopted = await self._fetch_state(peer, holder)
            if adopted is not None:
                return adopted
        return None

    async def _fetch_state(self, peer: PeerEntry, expected: StateInfo) -> Adopted | None:
        loop = asyncio.get_running_loop()
        bound = state_size_bound(expected.numel)
        if is_relay(peer.address):
            raw = None
            if self.relay is not None:
                raw = await self.relay.fetch_state(
                    peer.wallet, expected.round, bound + 64 * 1024, self.timings.state_timeout_s
                )
            if raw is None:
                return None
            try:
                info, body = decode_state_object(raw)
            except Refused as exc:
                self.log(f"state from {peer.wallet[:12]} refused: {exc}")
                return None
            reply = PeerReply(200, {STATE_HEADER: info.to_json().decode()}, body)
        else:
            http = await self.call(
                peer, "GET", STATE, max_bytes=bound, timeout_s=self.timings.state_timeout_s
            )
            if http is None or not http.ok:
                return None
            reply = http
        try:
            info = StateInfo.from_json(reply.headers.get(STATE_HEADER, ""))
            if info != expected:
                self.log(
                    f"state from {peer.wallet[:12]} is for round {info.round}, expected {expected.round}; skipped"
                )
                return None
            theta, momentum = await loop.run_in_executor(
                None, lambda: decode_state(reply.body, info.numel, with_momentum=bool(info.momentum_hash))
            )
        except Refused as exc:
            self.log(f"state from {peer.wallet[:12]} refused: {exc}")
            return None
        theta_hash = await loop.run_in_executor(None, tensor_digest, theta)
        momentum_hash = "" if momentum is None else await loop.run_in_executor(None, tensor_digest, momentum)
        if (theta_hash, momentum_hash) != (info.theta_hash, info.momentum_hash):
            self.log(f"state from {peer.wallet[:12]} does not match its hashes; skipped")
            return None
        return Adopted(info, theta, momentum)
