"""The asynchronous side of the protocol: gossip, one round's exchange, hash votes, state sync.

One outer round for this replica (ARCHITECTURE.md "One outer round"):

1. commit: its own signed header (the commitment: it binds payload_sha256) enters its own
   book through the same checks as everyone's, and digests carrying every commitment held
   are swapped with every live stage peer (each reply is that peer's digest, so one request
   informs both sides) until every live stage peer has committed or the commit deadline
   passed. No payload leaves this replica before that;
2. reveal: it signs a `Reveal` listing the commitments it holds now, keeps its own payload
   (peers may pull it from here on) and pushes reveal and payload to every live stage peer
   that committed (the others pull them after committing: the server answers payload
   requests of committed wallets only). A wallet in that list committed before this payload
   could be seen, so it cannot have copied it (screening.copiers);
3. digests keep being swapped and missing reveals and payloads pulled from whoever listed
   them, until the round can close:
   - a peer already closed the round: follow the largest closed set if it includes this
     replica (pull what is missing, then close with the same wallets), else this replica
     is late;
   - a peer reports a later round and holds no closed set for this one: late;
   - every live stage peer has been heard from (accepted, rejected or equivocating), and a
     digest swap started after that confirms it: a second signed header of a wallet, sent
     to other peers, shows up in their digests before this replica closes on the first;
   - the deadline passed: close with what is held;
   - the node is stopping: use what is held without publishing it as closed (a leaving
     replica's partial set must not pull the others along);
4. the caller aggregates the set (sorted by wallet) and steps; `agree` then collects the
   peers' θ hashes for the new round and the caller re-syncs if it is in the minority. A
   late replica skips its outer step and adopts the majority's new state (`sync_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from torch import Tensor

from . import wire
from .auth import PeerClient, PeerReply, PeerUnreachable
from .codec import decode_state, delta_size_bound, state_size_bound
from .peers import PeerEntry
from .quorum import backing, quorum, vouched
from .rounds import Contribution, RoundBook, Vote, plurality
from .server import NodeState
from .state import theta_sha256
from .wire import (
    Commitment,
    ContributionHeader,
    Digest,
    PeerList,
    Rejected,
    Reveal,
    StateInfo,
    WireError,
)

MIN_POLL_S = 0.02
"""First wait between digest swaps; it grows ×1.5 up to the configured digest interval."""
STATUS_BYTES = 4096
REVEAL_BYTES = 128 << 10
PEER_LIST_BYTES = 1 << 20


@dataclass(kw_only=True)
class ExchangeTimings:
    digest_interval_s: float
    hash_check_timeout_s: float
    state_timeout_s: float
    pull_grace_s: float
    commit_timeout_s: float
    """Longest wait, from the own contribution being ready, for the live stage peers' commitments
    before revealing anyway (at most half the round timeout)."""
    control_timeout_s: float
    """Whole-request limit of the small control requests (digests, statuses, peer lists): a peer
    that cannot answer one in this time is not worth waiting for within a round."""


@dataclass(frozen=True)
class Closed:
    contributions: tuple[Contribution, ...]
    """The set to aggregate, sorted by wallet."""


@dataclass(frozen=True)
class Late:
    reason: str


@dataclass(frozen=True)
class Adopted:
    info: StateInfo
    theta: Tensor
    momentum: Tensor | None


@dataclass(frozen=True)
class Agreement:
    vote: Vote
    """Hashes at the new round, this replica's own included."""
    ahead: int | None
    """The highest round a peer reported beyond the new one (this replica is behind), else None."""


class Exchange:
    def __init__(
        self, node: NodeState, client: PeerClient, timings: ExchangeTimings, log: Callable[[str], None]
    ) -> None:
        self.node = node
        self.client = client
        self.timings = timings
        self.log = log
        self._in_flight: set[tuple[int, str]] = set()
        self._background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Cancel pushes still in flight (the node is stopping)."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

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
        """A request to a known peer, with failure counting; None when it did not answer."""
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

    # --- discovery ----------------------------------------------------------------------------

    async def gossip_once(self) -> None:
        """Expire silent peers, then swap peer lists with every bootstrap address and live peer."""
        now = self.node.clock()
        for wallet in self.node.peers.expire(now):
            self.log(f"peer {wallet[:12]} expired: no fresh record for {self.node.peers.ttl_s:.0f} s")
        targets: dict[str, str | None] = dict.fromkeys(self.node.peers.bootstrap)
        for entry in self.node.peers.live(now):
            targets[entry.address] = entry.wallet
        targets.pop(self.node.address or "", None)
        await asyncio.gather(*(self._swap_peers(address, wallet) for address, wallet in targets.items()))

    async def _swap_peers(self, address: str, wallet: str | None) -> None:
        now = self.node.clock()
        try:
            reply = await self.client.request(
                "GET",
                address,
                wire.PEERS,
                max_bytes=PEER_LIST_BYTES,
                timeout_s=self.timings.control_timeout_s,
            )
            if not reply.ok:
                raise WireError(f"status {reply.status}: {reply.error()}")
            listed = PeerList.from_json(reply.body)
        except (PeerUnreachable, WireError):
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
                    wire.ANNOUNCE,
                    body=self.node.own_record().to_json(),
                    max_bytes=0,
                    timeout_s=self.timings.control_timeout_s,
                )

    # --- one round ----------------------------------------------------------------------------

    async def run_round(
        self,
        own: Contribution,
        timeout_s: float,
        stop: threading.Event,
        outgoing: Callable[[str], Contribution] | None = None,
    ) -> Closed | Late:
        """One round (module docstring). `outgoing` picks what is revealed to each peer wallet; None
        (every honest node) reveals `own` to all — only `neuroshard-node --attack` varies it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        commit_by = loop.time() + min(self.timings.commit_timeout_s, timeout_s / 2)
        r = own.header.round
        book = self.node.books.get(r)
        if book is None:
            raise RuntimeError(f"no book for round {r}: publish the round's snapshot first")
        try:
            self.node.commit(own.header)
        except Rejected as exc:
            self.log(f"round {r}: this replica's own commitment fails its own checks: {exc.detail}")
        late = await self._commit_phase(book, commit_by, stop)
        if late is not None:
            return late
        await self._reveal(own, book, outgoing)
        interval, next_swap = MIN_POLL_S, loop.time()
        complete_at: float | None = None
        """When every live peer was first heard from; a digest swap started later may close."""
        confirmed_at = -math.inf
        while True:
            if loop.time() >= next_swap:
                swap_started = loop.time()
                await self._swap_digests(r)
                confirmed_at = swap_started
                await self._pull_wanted(book)
                next_swap = loop.time() + interval
                interval = min(interval * 1.5, self.timings.digest_interval_s)
            outcome = self._follow(book)
            if outcome is not None:
                return outcome
            expected = {p.wallet for p in self.stage_peers()} | {self.own}
            if expected <= book.heard_from():
                complete_at = loop.time() if complete_at is None else complete_at
                if confirmed_at >= complete_at:
                    return Closed(book.close(book.accepted))
                next_swap = loop.time()  # confirm now
                continue
            if stop.is_set():
                return Closed(book.select(book.accepted))
            if loop.time() >= deadline:
                silent = sorted({p.wallet for p in self.stage_peers()} - book.heard_from())
                self.log(
                    f"round {r}: deadline of {timeout_s:.0f} s passed; closing with {len(book.accepted)} "
                    f"contribution(s), not heard from {', '.join(w[:12] for w in silent) or 'nobody'}"
                )
                return Closed(book.close(book.accepted))
            await self._wait(book, min(next_swap, deadline))

    async def _commit_phase(self, book: RoundBook, commit_by: float, stop: threading.Event) -> Late | None:
        """Swap digests until every live stage peer's commitment is held (or `commit_by`, or stop)."""
        loop = asyncio.get_running_loop()
        interval, next_swap = MIN_POLL_S, loop.time()
        while not stop.is_set():
            if loop.time() >= next_swap:  # a commitment pushed to this replica wakes it without a swap
                await self._swap_digests(book.round)
                next_swap = loop.time() + interval
                interval = min(interval * 1.5, self.timings.digest_interval_s)
            late = self._late(book)
            if late is not None:
                return late
            expected = {p.wallet for p in self.stage_peers()} | {self.own}
            if expected <= book.committed_from() or loop.time() >= commit_by:
                if loop.time() >= commit_by:
                    missing = sorted(expected - book.committed_from())
                    self.log(
                        f"round {book.round}: commit deadline passed; revealing without the commitments "
                        f"of {', '.join(w[:12] for w in missing)}"
                    )
                return None
            await self._wait(book, min(next_swap, commit_by))
        return None

    async def _wait(self, book: RoundBook, until: float) -> None:
        """Until something enters the book, or `until` (loop time)."""
        book.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(book.changed.wait(), max(0.0, until - asyncio.get_running_loop().time()))

    def reveal_of(self, contribution: Contribution, book: RoundBook) -> Reveal:
        """This replica's signed reveal of `contribution`: the commitments held now, its own included."""
        held = {w: h.payload_sha256 for w, h in book.committed.items()}
        held[self.own] = contribution.header.payload_sha256
        return Reveal.create(
            self.node.wallet,
            contribution=contribution.header,
            held=tuple(Commitment(wallet=w, payload_sha256=h) for w, h in sorted(held.items())),
        )

    async def _reveal(
        self, own: Contribution, book: RoundBook, outgoing: Callable[[str], Contribution] | None
    ) -> None:
        """Keep the own payload (servable from now on) and push reveal + payload to the committed peers."""
        book.revealed_at = self.node.clock()
        reveals: dict[str, Reveal] = {}

        def revealed(contribution: Contribution) -> Reveal:
            sha = contribution.header.payload_sha256
            if sha not in reveals:
                reveals[sha] = self.reveal_of(contribution, book)
            return reveals[sha]

        own_reveal = revealed(own)
        # Pushes run in the background: a slow or hung peer must not hold up the digests. The own
        # copy is checked (decoded) while they are on the wire.
        for peer in self.stage_peers():
            if peer.wallet not in book.committed:
                continue  # it pulls after committing
            sent = own if outgoing is None else outgoing(peer.wallet)
            task = asyncio.create_task(self._push(peer, sent, revealed(sent)))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        try:
            self.node.offer_reveal(own_reveal)
            await self.node.offer(own.header, own.payload)
        except (Rejected, WireError) as exc:
            self.log(f"round {book.round}: this replica's own contribution fails its own checks: {exc}")

    def _late(self, book: RoundBook) -> Late | None:
        if book.finals and self.own not in max(book.finals.values(), key=lambda w: (len(w), w)):
            return Late(f"peers closed round {book.round} without this replica")
        if book.ahead and not book.finals:
            return Late(f"peers are past round {book.round} and hold no closed set for it")
        return None

    def _follow(self, book: RoundBook) -> Closed | Late | None:
        """Follow the peers: close with the largest closed set if it includes this replica (once held),
        late if it does not, or if peers moved past the round without a closed set for it."""
        late = self._late(book)
        if late is not None or not book.finals:
            return late
        # The largest closed set (ties: the lexicographically largest) — the same pick on every replica.
        target = max(book.finals.values(), key=lambda wallets: (len(wallets), wallets))
        if set(target) <= book.heard_from():
            return Closed(book.close(target))
        return None

    async def _push(self, peer: PeerEntry, own: Contribution, reveal: Reveal) -> None:
        reply = await self.call(
            peer,
            "POST",
            wire.REVEAL,
            body=reveal.to_json(),
            max_bytes=0,
            timeout_s=self.timings.control_timeout_s,
        )
        if reply is None or reply.status not in (200, 204):
            if reply is not None:
                self.log(
                    f"peer {peer.wallet[:12]} refused round {own.header.round} reveal: {reply.status} {reply.error()}"
                )
            return
        reply = await self.call(
            peer,
            "POST",
            wire.CONTRIBUTION,
            body=own.payload,
            headers={wire.CONTRIBUTION_HEADER: own.header.to_json().decode()},
            max_bytes=0,
        )
        if reply is not None and reply.status not in (200, 204):
            self.log(
                f"peer {peer.wallet[:12]} refused round {own.header.round} contribution: {reply.status} {reply.error()}"
            )

    async def _swap_digests(self, round_: int) -> None:
        mine = self.node.digest(round_).to_json()

        async def swap(peer: PeerEntry) -> None:
            reply = await self.call(
                peer,
                "POST",
                wire.DIGEST,
                body=mine,
                max_bytes=self.node.limits.max_digest_bytes,
                timeout_s=self.timings.control_timeout_s,
            )
            if reply is None or not reply.ok:
                return
            try:
                theirs = Digest.from_json(reply.body)
            except WireError:
                return
            if theirs.wallet == peer.wallet and theirs.round == round_ and theirs.signature_valid():
                self.node.learn(theirs)

        await asyncio.gather(*(swap(peer) for peer in self.stage_peers()))

    async def _pull_wanted(self, book: RoundBook) -> None:
        """Pull what digests listed and this replica lacks — unless the contributor's own push is
        arriving or may still arrive (it is live and the listing is younger than the pull grace)."""
        heard = book.heard_from()
        now = self.node.clock()
        live = {p.wallet for p in self.stage_peers()}
        # A live contributor pushes once it reveals, which is after this replica committed: the
        # grace runs from this replica's own reveal at the earliest.
        since = book.revealed_at or -math.inf
        todo = [
            w
            for w in book.wanted
            if w not in heard
            and w != self.own
            and (book.round, w) not in self._in_flight
            and not self.node.uploads.get(w)
            and w not in book.checking
            and (w not in live or now - max(book.wanted_at.get(w, now), since) >= self.timings.pull_grace_s)
        ]
        await asyncio.gather(*(self._pull(book, wallet) for wallet in todo))

    async def _pull(self, book: RoundBook, wallet: str) -> None:
        key = (book.round, wallet)
        self._in_flight.add(key)
        try:
            now = self.node.clock()
            live = {e.wallet: e for e in self.node.peers.live(now)}
            order = [*sorted(book.sources.get(wallet, ())), wallet]
            for source in dict.fromkeys(order):
                peer = live.get(source)
                if peer is None or not await self._pull_reveal(book, wallet, peer):
                    continue
                reply = await self.call(
                    peer,
                    "GET",
                    wire.CONTRIBUTION_PULL.format(round=book.round, wallet=wallet),
                    max_bytes=delta_size_bound(book.numel),
                )
                if reply is None or not reply.ok:
                    continue
                try:
                    header = ContributionHeader.from_json(reply.headers.get(wire.CONTRIBUTION_HEADER, ""))
                    if header.wallet != wallet or header.round != book.round:
                        continue
                    await self.node.offer(header, reply.body)
                    return
                except (Rejected, WireError):
                    continue  # recorded by the book where the wallet's own signature makes it evidence
        finally:
            self._in_flight.discard(key)

    async def _pull_reveal(self, book: RoundBook, wallet: str, peer: PeerEntry) -> bool:
        """The contributor's reveal, from `peer` unless already held; True once it is held."""
        if wallet in book.reveals:
            return True
        reply = await self.call(
            peer,
            "GET",
            wire.REVEAL_PULL.format(round=book.round, wallet=wallet),
            max_bytes=REVEAL_BYTES,
            timeout_s=self.timings.control_timeout_s,
        )
        if reply is None or not reply.ok:
            return False
        try:
            reveal = Reveal.from_json(reply.body)
            if reveal.wallet != wallet or reveal.contribution.round != book.round:
                return False
            self.node.offer_reveal(reveal)
        except (Rejected, WireError):
            return False  # recorded by the book where the wallet's own signature makes it evidence
        return True

    async def gossip_round(self, round_: int) -> None:
        """One digest swap with every live stage peer, then pull what they listed (bounded)."""
        book = self.node.books.get(round_)
        await self._swap_digests(round_)
        if book is not None:
            await self._pull_wanted(book)

    # --- after a round: votes and state ---------------------------------------------------------

    async def statuses(self) -> list[StateInfo]:
        """Signed statuses of the live stage peers that answered."""

        async def ask(peer: PeerEntry) -> StateInfo | None:
            reply = await self.call(
                peer, "GET", wire.STATUS, max_bytes=STATUS_BYTES, timeout_s=self.timings.control_timeout_s
            )
            if reply is None or not reply.ok:
                return None
            try:
                info = StateInfo.from_json(reply.body)
            except WireError:
                return None
            if info.wallet != peer.wallet or info.stage != self.node.stage or not info.signature_valid():
                return None
            self.node.peer_rounds[peer.wallet] = (info.round, info.theta_hash)
            return info

        answers = await asyncio.gather(*(ask(peer) for peer in self.stage_peers()))
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
        while True:
            infos = await self.statuses()
            # Ahead only if a quorum vouches for a later state: one status claiming a far round must
            # not send this replica hunting for a state nobody else holds (quorum.py).
            later = vouched(infos, new_round + 1, len(infos) + 1)
            ahead = None if later is None else later.round
            pending = {i.wallet for i in infos if i.wallet in waiting_for and i.round < new_round}
            if ahead is not None or not pending or loop.time() >= deadline or stop.is_set():
                vote = plurality(infos, new_round, own_hash)
                assert vote is not None  # own_hash always counts
                return Agreement(vote, ahead)
            await asyncio.sleep(interval)
            interval = min(interval * 1.5, self.timings.digest_interval_s)

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
            interval = min(interval * 1.5, self.timings.digest_interval_s)

    async def fetch_from(self, vote: Vote, need: int = 1) -> Adopted | None:
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
        reply = await self.call(
            peer,
            "GET",
            wire.STATE,
            max_bytes=state_size_bound(expected.numel),
            timeout_s=self.timings.state_timeout_s,
        )
        if reply is None or not reply.ok:
            return None
        loop = asyncio.get_running_loop()
        try:
            info = StateInfo.from_json(reply.headers.get(wire.STATE_HEADER, ""))
            if info != expected:
                self.log(
                    f"state from {peer.wallet[:12]} is for round {info.round}, expected {expected.round}; skipped"
                )
                return None
            theta, momentum = await loop.run_in_executor(
                None, lambda: decode_state(reply.body, info.numel, with_momentum=bool(info.momentum_hash))
            )
        except WireError as exc:
            self.log(f"state from {peer.wallet[:12]} refused: {exc}")
            return None
        theta_hash = await loop.run_in_executor(None, theta_sha256, theta)
        momentum_hash = "" if momentum is None else await loop.run_in_executor(None, theta_sha256, momentum)
        if (theta_hash, momentum_hash) != (info.theta_hash, info.momentum_hash):
            self.log(f"state from {peer.wallet[:12]} does not match its hashes; skipped")
            return None
        return Adopted(info, theta, momentum)
