"""The peer table: who is out there, where, and whether they answer.

Peers are known by wallet, never by address alone: a record enters the table only with a
valid signature by the wallet it names (so nobody can point another replica's identity at
their own address), and of two records of one wallet the fresher `last_seen` wins. A
replica re-signs its record every gossip interval; a record not refreshed for `ttl_s`
expires. Transport failures are counted per wallet; `ban_after` in a row ban the peer for
`ban_s` (then it gets a fresh chance).

Bootstrap addresses (``--peers host:port,…``) are only where to ask first: their wallets
become known from the self-signed records they serve at GET /p2p/peers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from neuroshard.protocol.peer import PeerRecord

CLOCK_SKEW_S = 60.0
"""A record signed further in the future than this is refused: it would never expire."""


@dataclass
class PeerEntry:
    record: PeerRecord
    first_seen: float = 0.0
    """When this table first took a record of the wallet (the round's member list counts peers
    first seen after the last θ-hash vote as joiners)."""
    failures: int = 0
    banned_until: float = 0.0

    @property
    def wallet(self) -> str:
        return self.record.wallet

    @property
    def address(self) -> str:
        return self.record.address


class PeerTable:
    """Known peers (all stages), keyed by wallet. Not thread-safe: the network's event loop owns it."""

    def __init__(
        self, *, own_wallet: str, bootstrap: Iterable[str] = (), ttl_s: float, ban_after: int, ban_s: float
    ) -> None:
        if ttl_s <= 0 or ban_after < 1 or ban_s < 0:
            raise ValueError(
                f"PeerTable needs ttl_s > 0, ban_after >= 1, ban_s >= 0; got {ttl_s}, {ban_after}, {ban_s}"
            )
        self.own_wallet = own_wallet
        self.bootstrap = tuple(dict.fromkeys(bootstrap))
        self.ttl_s = ttl_s
        self.ban_after = ban_after
        self.ban_s = ban_s
        self._entries: dict[str, PeerEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, wallet: str) -> PeerEntry | None:
        return self._entries.get(wallet)

    def merge(self, records: Iterable[PeerRecord], now: float) -> int:
        """Take the records that are validly self-signed, fresh and fresher than ours; returns how many."""
        taken = 0
        for record in records:
            if record.wallet == self.own_wallet:
                continue
            if not (now - self.ttl_s <= record.last_seen <= now + CLOCK_SKEW_S):
                continue
            known = self._entries.get(record.wallet)
            if known is not None and known.record.last_seen >= record.last_seen:
                continue
            if not record.signature_valid():
                continue
            if known is None:
                self._entries[record.wallet] = PeerEntry(record, first_seen=now)
            else:
                known.record = record
            taken += 1
        return taken

    def expire(self, now: float) -> list[str]:
        """Drop peers whose record was not refreshed within the TTL; returns their wallets."""
        dead = [w for w, e in self._entries.items() if e.record.last_seen < now - self.ttl_s]
        for wallet in dead:
            del self._entries[wallet]
        return dead

    def live(self, now: float, stage: int | None = None) -> list[PeerEntry]:
        """Unexpired, unbanned peers (of `stage` if given), sorted by wallet for a stable order."""
        return [e for e in self.unexpired(now, stage) if e.banned_until <= now]

    def unexpired(self, now: float, stage: int | None = None) -> list[PeerEntry]:
        """Unexpired peers (of `stage` if given), banned or not, sorted by wallet."""
        return sorted(
            (
                e
                for e in self._entries.values()
                if e.record.last_seen >= now - self.ttl_s and (stage is None or e.record.stage == stage)
            ),
            key=lambda e: e.wallet,
        )

    def records(self, now: float) -> list[PeerRecord]:
        """What we tell others at GET /p2p/peers: every unexpired record, banned or not (a ban is our
        local opinion of the link, not evidence against the peer)."""
        return [e.record for e in self._entries.values() if e.record.last_seen >= now - self.ttl_s]

    def failed(self, wallet: str, now: float) -> bool:
        """Count a transport failure; True if this one started a ban."""
        entry = self._entries.get(wallet)
        if entry is None:
            return False
        entry.failures += 1
        if entry.failures >= self.ban_after:
            entry.failures = 0
            entry.banned_until = now + self.ban_s
            return True
        return False

    def succeeded(self, wallet: str) -> None:
        entry = self._entries.get(wallet)
        if entry is not None:
            entry.failures = 0
            entry.banned_until = 0.0
